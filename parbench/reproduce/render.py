"""A :class:`~.core.Reproduction` as markdown: ``results/reference/NAME.md``."""
from __future__ import annotations

from pathlib import Path

from .core import Cell, Reproduction, Table, fmt_percent, fmt_value


def _esc(text: str) -> str:
    return str(text).replace("|", "\\|")


def _figure(x: float, unit: str) -> str:
    v = fmt_value(x)
    return f"{v} {unit}" if unit and unit not in ("%", "x") else f"{v}{unit}"


def _verdict(c: Cell, tolerance: float) -> str:
    if c.within(tolerance):
        return "yes"
    return "no, explained" if c.explained else "**NO**"


def _cell_row(c: Cell, tolerance: float) -> str:
    published = c.printed + (f" {c.unit}" if c.unit and c.unit not in ("%", "x") else c.unit) \
        if c.printed is not None else _figure(c.published, c.unit)
    if c.unconfirmed:
        published += " (unconfirmed)"
    precision = {"rounds": "rounds to it", "truncates": "truncates to it",
                 "differs": "differs", None: ""}[c.at_printed_precision]
    return (f"| {_esc(c.label)} | {_esc(published)} | {_esc(_figure(c.tool, c.unit))} | "
            f"{fmt_percent(c.rel_error)} | {_verdict(c, tolerance)} | {precision} | "
            f"{_esc(c.note)} |")


def render_table(t: Table) -> list[str]:
    out = [f"## {t.title}", "",
           f"Source: {t.source.paper}, {t.source.where}. ", f"Checked: {t.source.checked}.", "",
           "Configuration:", "", "| quantity | value | where it comes from |", "|---|---|---|"]
    out += [f"| {_esc(s.name)} | {_esc(s.value)} | {_esc(s.source)} |" for s in t.config]
    out += ["", f"Tool: `{t.method}`.", "",
            f"| cell | published | tool | relative error | within {fmt_percent(t.tolerance)} "
            "| at the printed precision | note |",
            "|---|---|---|---|---|---|---|"]
    out += [_cell_row(c, t.tolerance) for c in t.cells]
    out += ["", f"**{t.summary()}.**"]
    precise = [c for c in t.cells if c.printed is not None]
    if precise:
        agree = sum(c.at_printed_precision != "differs" for c in precise)
        out[-1] += (f" {agree} of {len(precise)} printed cells agree with the tool's figure at "
                    "the printed precision.")
    if t.notes:
        out += [""] + [f"- {_esc(n)}" for n in t.notes]
    return out + [""]


def render_markdown(r: Reproduction) -> str:
    """The whole reproduction as one markdown document."""
    out = [f"# {r.title}", "",
           f"Written by `parbench reproduce {r.name}`. Every *tool* figure is computed when the "
           "command runs, from the configuration shown, with parbench's closed forms "
           "(`parbench.analytic`), its schedule simulator (`parbench.schedules`) or its time "
           "model (`parbench.timemodel`); every "
           f"*published* figure is data in `parbench/reproduce/{r.name.replace('-', '_')}.py`"
           " with its source. A published figure marked *unconfirmed* could not be checked "
           "against a text copy of the paper. Relative error = |tool - published| / "
           "|published|.", ""]
    if r.intro:
        out += [r.intro, ""]
    out += [f"**Summary: {r.summary()}.**", ""]
    out += [f"- {t.title}: {t.summary()}" for t in r.tables] + [""]
    for t in r.tables:
        out += render_table(t)
    return "\n".join(out).rstrip() + "\n"


def write_markdown(r: Reproduction, out_dir: str | Path) -> Path:
    """Write ``OUT_DIR/NAME.md`` and return its path."""
    path = Path(out_dir) / f"{r.name}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_markdown(r))
    return path
