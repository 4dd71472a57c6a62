"""Formatting one row's figures into table cells (shared by the tables and the markdown)."""
from __future__ import annotations

from ..layout import DEGREES
from ..results import Row

#: the pipeline's bubble ratios (``BubbleFigures.ratios()``), folded into one column
BUBBLE_COLUMN = "bubble: measured / replayed /\nsim (mean costs) / unit / closed form"
#: the pipeline's further columns of the wide table: header -> BubbleFigures field
PIPELINE_COLUMNS = {"schedule": "schedule", "held_graphs": "held_graphs"}


def fmt_bytes(n) -> str:
    if n is None:
        return "—"
    n = float(n)
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= div:
            return f"{n / div:.4g} {unit}"
    return f"{n:.0f} B"


def fmt_sci(x) -> str:
    return "—" if x is None else f"{x:.1e}"


def fmt_ms(seconds) -> str:
    return f"{seconds * 1e3:.2f}" if seconds else "—"


def fmt_pct(x) -> str:
    return "—" if x is None else f"{100 * x:.1f}%"


def degrees(row: Row) -> str:
    d = row.case.degrees()
    parts = [f"{a}{d[a]}" for a in DEGREES if d.get(a, 1) > 1]
    if d.get("vpp", 1) > 1:
        parts.append(f"v{d['vpp']}")
    return " ".join(parts) or "1"


def verdict(row: Row, markup: bool = True) -> str:
    v = row.verdict
    if v.status != "ok":
        kind = v.failure.kind if v.failure else "failed"
        return f"[red]{kind.upper()}[/]" if markup else kind.upper()
    if v.equivalent:
        return "[green]pass[/]" if markup else "pass"
    if v.known_finding:  # a framework's disagreement already reported (Scheme.known_finding)
        return "[yellow]FINDING[/]" if markup else "FINDING"
    return "[red]FAIL[/]" if markup else "FAIL"


def update_check(row: Row) -> str:
    """'ok 0.0' (largest error in units of the tolerance), and the smallest weight-decay
    error this row's comparison sees."""
    v = row.verdict
    seen = fmt_sci(v.detectable_wd_error)
    if v.update_ok is None:
        return f"n/a (own rule)\nwd ≥ {seen}"
    state = "ok" if v.update_ok else "[red]FAIL[/]"
    return f"{state} {v.max_update_excess or 0:.2g}\nwd ≥ {seen}"


def short_scheme(name: str) -> str:
    return name.replace("baseline.", "")


def vs(measured, predicted, exact: bool | None = None, compact: bool = False) -> str:
    """'x =' when measured equals predicted (on every rank, if ``exact`` says so), else
    'x / predicted' ('x ≠' when ``compact``)."""
    if predicted is None:
        return fmt_bytes(measured)
    if exact is None:
        exact = measured is not None and abs(float(measured) - float(predicted)) < 0.5
    if exact:
        return f"{fmt_bytes(measured)} ="
    if compact:
        return f"{fmt_bytes(measured)} ≠"
    return f"{fmt_bytes(measured)} / {fmt_bytes(predicted)}"


def states(row: Row, compact: bool = False) -> str:
    """Rank 0's model states, '=' when every rank equals its closed form on every step."""
    ms = row.memory.states
    meas = (ms.totals() or [None])[0]
    if not meas:
        return "—"
    pred = (ms.predicted_totals() or [None])[0]
    if not pred:
        return fmt_bytes(meas)
    return vs(meas, pred, ms.exact, compact)


def wire_total(row: Row, compact: bool = False) -> str:
    """All axes summed, largest rank: 'x =' when every rank equals its prediction."""
    t = row.traffic
    meas, pred = t.wire_max(), t.wire_predicted_max()
    if not meas and not pred:
        return "—"
    exact = t.wire_exact if t.calls_exact is not False else False
    total = sum(v for v in (pred or {}).values() if v)
    return vs(sum(meas.values()), total if pred is not None else None, exact, compact)


def wire_detail(row: Row) -> str:
    """Per axis: measured (= predicted), then the calls actually made, e.g. all_reduce×7."""
    t = row.traffic
    meas = t.wire_max()
    pred = t.wire_predicted_max() or {}
    axes = sorted(set(meas) | set(k for k, v in pred.items() if v))
    if not axes:
        return "—"
    calls: dict[str, list[str]] = {}
    for e in t.ops:
        if e.wire_bytes or e.op not in ("recv", "barrier"):
            calls.setdefault(e.axis, []).append(f"{e.op}×{e.count}")
    exact = t.wire_exact
    return "\n".join(f"{a} {vs(meas.get(a, 0.0), pred.get(a), exact if a in pred else None)}"
                     + (f"\n  {' '.join(calls[a])}" if a in calls else "") for a in axes)


def peak(row: Row, per_rank: bool = True) -> str:
    """Largest peak per rank; every rank's when they differ by more than 5% (pipeline
    stages) and ``per_rank``."""
    peaks = [p for p in row.memory.peak_bytes if p is not None]
    if not peaks:
        return "—"
    if per_rank and max(peaks) > 1.05 * min(peaks):
        return "\n".join(f"r{i} {fmt_bytes(p)}" for i, p in enumerate(peaks))
    if per_rank and row.memory.peak_predicted:
        return f"{fmt_bytes(max(peaks))}\nanalytic {fmt_bytes(row.memory.peak_predicted)}"
    return fmt_bytes(max(peaks))


def paper_states(row: Row) -> str | None:
    """The ZeRO paper's mixed-precision accounting (2+2+K, K=12) for this rank, if given."""
    paper = row.memory.states.paper
    return None if paper is None else fmt_bytes(paper)


def bubbles(row: Row) -> str:
    """Measured / replayed / simulated (mean costs) / unit / closed form."""
    if row.pipeline is None or all(v is None for v in row.pipeline.ratios()):
        return "—"
    return " / ".join(fmt_pct(v) for v in row.pipeline.ratios())


def replayed_bubble(row: Row) -> str:
    return fmt_pct(row.pipeline.replayed if row.pipeline else None)


def fmt_figure(v) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def figure_columns(rows: list[Row]) -> list[str]:
    """The wide table's further columns: the pipeline's (schedule, held graphs, the bubble
    ratios folded into one), then the scalar scheme figures of these rows."""
    keys: list[str] = []
    if any(r.pipeline is not None for r in rows):
        keys += [*PIPELINE_COLUMNS, BUBBLE_COLUMN]
    for r in rows:
        for k, v in r.scheme_figures.items():
            if k not in keys and (v is None or isinstance(v, (int, float, str))):
                keys.append(k)
    return keys


def figure_value(row: Row, key: str) -> str:
    if key == BUBBLE_COLUMN:
        return bubbles(row)
    if key in PIPELINE_COLUMNS:
        return fmt_figure(getattr(row.pipeline, PIPELINE_COLUMNS[key]) if row.pipeline
                          else None)
    return fmt_figure(row.scheme_figures.get(key))
