"""Result tables, one per family: compact by default (fits a 100-column terminal), every
column with ``wide=True`` (``--wide``)."""
from __future__ import annotations

from dataclasses import astuple

from rich import box
from rich.console import Console
from rich.table import Table

from ..results import Row, Tolerance
from . import cells


def _same_case(a: Row, b: Row) -> bool:
    ca, cb = dict(a.case.config), dict(b.case.config)
    ra, rb = dict(ca["run"]), dict(cb["run"])
    ra.pop("scheme"), rb.pop("scheme")
    same = ("model", "layout", "options")
    return all(ca.get(k) == cb.get(k) for k in same) and ra == rb


def baseline_ratios(rows: list[Row]) -> dict[str, list[tuple[str, float]]]:
    """For each native row id: [(baseline scheme, our step time / baseline step time)]."""
    out: dict[str, list] = {}
    for b in rows:
        base_of, base_s = b.case.baseline_of, b.time.step_s
        if not base_of or not base_s:
            continue
        for r in rows:
            if r.scheme == base_of and r.time.step_s and _same_case(r, b):
                out.setdefault(r.id, []).append((b.scheme, r.time.step_s / base_s))
    return out


def _uniform_tolerance(rows: list[Row]) -> Tolerance | None:
    tols = {astuple(r.verdict.tolerance) for r in rows}
    return Tolerance(*next(iter(tols))) if len(tols) == 1 else None


def _caption(rows: list[Row], shared: list[Row], uniform: Tolerance | None,
             compact: bool = False) -> str:
    stored = sum(r.verdict.golden_source.startswith("stored") for r in rows)
    if compact:
        caption = ("bytes per rank per step, largest rank; '=' every rank equals its closed "
                   "form on every step, '≠' not (--wide shows both); KiB = 2^10 B; golden: "
                   f"{stored} stored, {len(rows) - stored} live")
    else:
        caption = ("bytes per rank per step, largest rank; 'x =' means every rank equals its "
                   "prediction on every checked step; KiB = 2^10 B, MiB = 2^20 B; golden "
                   f"runs: {stored} from committed files, {len(rows) - stored} live")
        if uniform and uniform.derived:
            caption += (f"; losses and gradients against the golden model at the scheme's "
                        f"weights, to tolerances derived from each step's bf16 rounding "
                        f"noise ({uniform.derived}); final parameters: param_atol "
                        f"{uniform.param_atol:.0e}")
        elif uniform:
            caption += (f"; losses and gradients against the golden model at the scheme's "
                        f"weights: rtol {uniform.rtol:.0e}, atol "
                        f"{uniform.atol:.0e} (tensor-wise); drift from the golden "
                        f"trajectory: param_atol {uniform.param_atol:.0e} where the "
                        "update check does not apply")
    if shared:
        caption += (f"; {len(shared)} case(s) ran more ranks than the host's "
                    f"{shared[0].env.host_cpus} cores (marked *)" +
                    ("" if compact else ": their wall-clock times and measured bubbles "
                     "include core sharing"))
    return caption


def _tolerance_cell(tol: Tolerance, detectable: float | None) -> str:
    """The row's tolerances: stated (rtol, atol, param_atol), or derived per tensor from the
    step's own rounding noise (a bf16 row: the largest as a fraction of its tensor's scale)."""
    if tol.derived and detectable is not None:
        return f"derived\n<= {detectable:.0%} of scale\nparam {tol.param_atol:.0e}"
    return f"rtol {tol.rtol:.0e}\natol {tol.atol:.0e}\nparam {tol.param_atol:.0e}"


def _by_family(rows: list[Row]) -> dict[str, list[Row]]:
    fams: dict[str, list[Row]] = {}
    for r in rows:
        fams.setdefault(r.case.family or "?", []).append(r)
    return fams


def compact_table(fam: str, rows: list[Row], ratios: dict) -> Table:
    """The headline figures: verdict, time, ratio to the baseline, bytes, states, peak (and
    the replayed bubble for pipelines)."""
    shared = [r for r in rows if r.shares_cores]
    t = Table(title=f"{fam} — {len(rows)} case(s)",
              caption=_caption(rows, shared, _uniform_tolerance(rows), compact=True),
              box=box.SIMPLE_HEAD,
              show_edge=False, padding=(0, 1), collapse_padding=True)
    t.add_column("scheme", overflow="fold")
    t.add_column("deg", no_wrap=True)
    t.add_column("ok", no_wrap=True)
    t.add_column("ms/step", justify="right", no_wrap=True)
    t.add_column("ours/base", no_wrap=True)
    t.add_column("wire/rank", no_wrap=True)
    t.add_column("states", no_wrap=True)
    t.add_column("peak", no_wrap=True)
    pipeline = any(r.pipeline is not None for r in rows)
    if pipeline:
        t.add_column("bubble", no_wrap=True)
    for r in rows:
        rat = ratios.get(r.id, [])
        cols = [cells.short_scheme(r.scheme), cells.degrees(r) + ("*" if r in shared else ""),
                cells.verdict(r), cells.fmt_ms(r.time.step_s),
                " ".join(f"{v:.2f}×" for _, v in rat) or "—",
                cells.wire_total(r, True), cells.states(r, True), cells.peak(r, per_rank=False)]
        if pipeline:
            cols.append(cells.replayed_bubble(r))
        t.add_row(*cols)
    return t


def wide_table(fam: str, rows: list[Row], ratios: dict) -> Table:
    """Every figure of every row."""
    uniform = _uniform_tolerance(rows)
    shared = [r for r in rows if r.shares_cores]
    t = Table(title=f"{fam} — {len(rows)} case(s)", caption=_caption(rows, shared, uniform),
              show_lines=True)
    cols = ["scheme", "degrees", "golden", "max |Δ| loss/grad/param(drift)",
            "update check / wd error seen", "tolerance", "step ms", "tok/s", "peak/rank",
            "model states", "wire bytes", "ours / baseline"]
    if uniform:
        cols.remove("tolerance")
    for col in cols:
        t.add_column(col, overflow="fold")
    further = cells.figure_columns(rows)
    paper = any(cells.paper_states(r) for r in rows)
    if paper:
        t.add_column("ZeRO paper 2+2+K", overflow="fold")
    for k in further:
        t.add_column(k, overflow="fold")
    for r in rows:
        v, tol = r.verdict, r.verdict.tolerance
        rat = ratios.get(r.id, [])
        rat_s = "\n".join(f"{v:.2f}× {cells.short_scheme(b)}" for b, v in rat) or "—"
        tol_cell = [] if uniform else [_tolerance_cell(tol, v.detectable_grad_error)]
        t.add_row(
            r.scheme, cells.degrees(r) + ("*" if r in shared else ""), cells.verdict(r),
            "\n".join(cells.fmt_sci(x) for x in (v.max_loss_abs, v.max_grad_abs,
                                                 v.max_param_abs)),
            cells.update_check(r), *tol_cell, _step_cell(r),
            f"{r.time.tokens_per_s:.0f}" if r.time.tokens_per_s else "—",
            cells.peak(r), cells.states(r), cells.wire_detail(r), rat_s,
            *([cells.paper_states(r) or "—"] if paper else []),
            *[cells.figure_value(r, k) for k in further])
    return t


def _step_cell(r: Row) -> str:
    """The median step, and the verdict's share of the case's wall time (issue 24)."""
    share = r.time.verdict_share
    return cells.fmt_ms(r.time.step_s) + (f"\nverdict {share:.0%} of the case's "
                                           f"{r.time.case_s:.1f} s" if share is not None
                                           and r.time.case_s else "")


def tables(rows: list[Row], wide: bool = False) -> list[Table]:
    ratios = baseline_ratios(rows)
    make = wide_table if wide else compact_table
    return [make(fam, frows, ratios) for fam, frows in _by_family(rows).items()]


def print_tables(rows: list[Row], console: Console | None = None, wide: bool = False) -> None:
    """Print the tables; wide tables get at least 200 columns (they scroll, not wrap)."""
    console = console or Console()
    if wide and console.width < 200:
        console = Console(width=200, file=console.file)
    for t in tables(rows, wide=wide):
        console.print(t)
    for r in rows:
        f = r.verdict.failure
        if r.verdict.status != "ok" and f:
            console.print(f"[red]{r.scheme} {cells.degrees(r)}: {f.kind} on rank "
                          f"{f.rank}[/]: {f.message}")
