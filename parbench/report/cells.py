"""Formatting one row's figures into table cells (shared by the tables and the markdown)."""
from __future__ import annotations

from ..results import Row

#: pipeline bubble ratios, folded into one column in this order
BUBBLE_KEYS = ("bubble_measured", "bubble_replayed", "bubble_sim_mean_costs", "bubble_unit",
               "bubble_closed_form")
BUBBLE_COLUMN = "bubble: measured / replayed /\nsim (mean costs) / unit / closed form"


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


def degrees(row: Row) -> str:
    d = row.degrees
    parts = [f"{a}{d[a]}" for a in ("tp", "cp", "ep", "dp", "pp") if d.get(a, 1) > 1]
    if d.get("vpp", 1) > 1:
        parts.append(f"v{d['vpp']}")
    return " ".join(parts) or "1"


def verdict(row: Row, markup: bool = True) -> str:
    if row.status != "ok":
        kind = row.failure.kind if row.failure else "failed"
        return f"[red]{kind.upper()}[/]" if markup else kind.upper()
    if row.equivalent:
        return "[green]pass[/]" if markup else "pass"
    return "[red]FAIL[/]" if markup else "FAIL"


def update_check(row: Row) -> str:
    """'ok 0.0' (largest error in units of the tolerance), and the smallest weight-decay
    error this row's comparison sees."""
    seen = fmt_sci(row.detectable_wd_error)
    if row.update_ok is None:
        return f"n/a (own rule)\nwd ≥ {seen}"
    state = "ok" if row.update_ok else "[red]FAIL[/]"
    return f"{state} {row.max_update_excess or 0:.2g}\nwd ≥ {seen}"


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
    meas = (row.model_state_bytes or [None])[0]
    if not meas:
        return "—"
    pred = (row.model_state_bytes_predicted or [None])[0]
    total = sum(meas.values())
    if not pred:
        return fmt_bytes(total)
    return vs(total, sum(pred.values()), row.model_state_exact, compact)


def wire_total(row: Row, compact: bool = False) -> str:
    """All axes summed, largest rank: 'x =' when every rank equals its prediction."""
    if not row.wire_bytes and not row.wire_bytes_predicted:
        return "—"
    meas = sum(row.wire_bytes.values())
    pred = sum(v for v in (row.wire_bytes_predicted or {}).values() if v)
    exact = row.wire_exact if row.calls_exact is not False else False
    return vs(meas, pred if row.wire_bytes_predicted else None, exact, compact)


def wire_detail(row: Row) -> str:
    """Per axis: measured (= predicted), then the calls actually made, e.g. all_reduce×7."""
    meas = row.wire_bytes
    pred = row.wire_bytes_predicted or {}
    axes = sorted(set(meas) | set(k for k, v in pred.items() if v))
    if not axes:
        return "—"
    calls: dict[str, list[str]] = {}
    for key, e in row.ledger_summary.items():
        axis, op = key.split("/", 1)
        if e["wire_bytes"] or op not in ("recv", "barrier"):
            calls.setdefault(axis, []).append(f"{op}×{e['count']}")
    exact = row.wire_exact
    return "\n".join(f"{a} {vs(meas.get(a, 0.0), pred.get(a), exact if a in pred else None)}"
                     + (f"\n  {' '.join(calls[a])}" if a in calls else "") for a in axes)


def peak(row: Row, per_rank: bool = True) -> str:
    """Largest peak per rank; every rank's when they differ by more than 5% (pipeline
    stages) and ``per_rank``."""
    peaks = [p for p in row.peak_bytes if p is not None]
    if not peaks:
        return "—"
    if per_rank and max(peaks) > 1.05 * min(peaks):
        return "\n".join(f"r{i} {fmt_bytes(p)}" for i, p in enumerate(peaks))
    if per_rank and row.peak_bytes_predicted:
        return f"{fmt_bytes(max(peaks))}\nanalytic {fmt_bytes(row.peak_bytes_predicted)}"
    return fmt_bytes(max(peaks))


def paper_states(row: Row) -> str | None:
    """The ZeRO paper's mixed-precision accounting (2+2+K, K=12) for this rank, if given."""
    paper = row.prediction.get("paper") or {}
    mixed = (paper.get("model_state_bytes") or {}).get("mixed_adam")
    return fmt_bytes(mixed["total"]) if mixed else None


def bubbles(row: Row, keys=BUBBLE_KEYS) -> str:
    vals = [row.extra.get(k) for k in keys]
    if all(v is None for v in vals):
        return "—"
    return " / ".join("—" if v is None else f"{100 * v:.1f}%" for v in vals)


def fmt_extra(v) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def extra_keys(rows: list[Row]) -> list[str]:
    """The scalar extras of these rows, bubble figures folded into one column."""
    keys: list[str] = []
    for r in rows:
        for k, v in r.extra.items():
            if k in BUBBLE_KEYS:
                k = BUBBLE_COLUMN
            if k not in keys and (v is None or isinstance(v, (int, float, str))):
                keys.append(k)
    return keys


def extra_value(row: Row, key: str) -> str:
    if key == BUBBLE_COLUMN:
        return bubbles(row)
    return fmt_extra(row.extra.get(key))
