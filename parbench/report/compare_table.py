"""``parbench compare``'s output: the one-line regression messages and the rich table of
:func:`parbench.report.compare.compare_rows`' diffs."""
from __future__ import annotations

from . import cells
from .compare import (BYTES_SLACK, TIME_FLOOR, TIME_K, Diff, Options, TimeDiff, _grew, _pct,
                      _rank, _whats, signed_bytes)


def regression_line(d: Diff) -> str:
    """One line naming a regressed row and why."""
    ident = d.old_id if d.old_id == d.new_id or not d.new_id else f"{d.old_id} → {d.new_id}"
    return f"{d.label} [{ident}]: {'; '.join(d.reasons)}"


# ---- the table ---------------------------------------------------------------------------


def _verdict_cell(d: Diff) -> str:
    vo, vn = d.verdict
    if vo is None:
        return f"— → {vn}"
    if vn is None:
        return f"{vo} → —"
    if vo == vn:
        return vo
    color = "red" if _rank(vn) < _rank(vo) else "green"
    return f"[{color}]{vo} → {vn}[/]"


def _delta_cell(pairs: dict[str, list], unit_bytes: bool, total: bool, tol: float,
                gated: bool = True) -> str:
    """'= total' when nothing changed, else one line per changed key ('dp +8 B (+0.1%)'):
    red when it is a regression, yellow when it rose but is not gated, green when it fell."""
    if not pairs:
        return "—"
    changed = [(k, o or 0, n or 0) for k, (o, n) in pairs.items()
               if abs((n or 0) - (o or 0)) > (BYTES_SLACK if unit_bytes else 0)]
    if not changed:
        vals = [n or 0 for _, n in pairs.values()]
        agg = sum(vals) if total else max(vals)
        return "= " + (cells.fmt_bytes(agg) if unit_bytes else str(int(agg)))
    lines = []
    for k, o, n in changed:
        delta = signed_bytes(n - o) if unit_bytes else f"{n - o:+d} ({o}→{n})"
        grew = _grew(o, n, tol, BYTES_SLACK if unit_bytes else 0)
        color = ("red" if gated else "yellow") if grew else "green" if n < o else "yellow"
        lines.append(f"[{color}]{k} {delta}{_pct(o, n) if unit_bytes else ''}[/]")
    return "\n".join(lines)


def _time_cell(t: TimeDiff, gated: bool = True) -> str:
    if t.ratio is None:
        return t.note or "—"
    ratio = f"{t.ratio:.2f}×"
    if t.threshold is None:
        return f"{ratio} ({t.note})"
    color = ("red" if gated else "yellow") if t.ratio > 1 + t.threshold else ""
    text = f"{ratio} (≤{1 + t.threshold:.2f}×{'' if t.source == 'auto' else ' fixed'})"
    return f"[{color}]{text}[/]" if color else text


def _status_cell(d: Diff) -> str:
    if d.status == "new":
        return "[dim]new[/]"
    if d.status == "missing":
        return "[red]REGRESSION: missing in NEW[/]"
    if d.reasons:
        return "[red]REGRESSION: " + _whats(d.reasons) + "[/]"
    text = "[green]ok[/]"
    if d.improvements:
        text += " [green](better: " + _whats(d.improvements) + ")[/]"
    if d.findings:
        text += " [yellow](baseline finding: " + _whats(d.findings) + ")[/]"
    return text


def table(diffs: list[Diff], old_name: str = "OLD", new_name: str = "NEW",
          opts: Options | None = None):
    """The rich table: one row per case."""
    from rich import box
    from rich.table import Table

    opts = opts or Options()
    n_reg = sum(d.regression for d in diffs)
    caption = ("Δ = NEW − OLD, '=' unchanged; wire, calls: per step, largest rank, per axis; "
               "states, peak: per rank; time: NEW/OLD median step time, ≤ the ratio allowed ("
               + (f"time_tol={opts.time_tol:g}" if opts.time_tol is not None else
                  f"auto: 1 + max({TIME_FLOOR:g}, {TIME_K:g}·√(s_old²+s_new²)), s the robust "
                  "relative spread of the timed steps") +
               f"); bytes_tol={opts.bytes_tol:g}; "
               + ("baselines gate like native schemes" if opts.gate_baselines else
                  "a baseline's figures are findings, its verdict gates") + "; KiB = 2^10 B")
    t = Table(title=f"compare {old_name} → {new_name} — {len(diffs)} case(s), "
                    f"{n_reg} regression(s)",
              caption=caption, box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 1),
              collapse_padding=True)
    for name in ("case", "verdict", "wire Δ", "calls Δ", "states Δ", "peak Δ", "time ratio",
                 "status"):
        t.add_column(name, overflow="fold")
    for d in diffs:
        t.add_row(d.label, _verdict_cell(d),
                  _delta_cell(d.wire, True, True, opts.bytes_tol, d.gated),
                  _delta_cell(d.calls, False, True, opts.bytes_tol, d.gated),
                  _delta_cell(d.states, True, False, opts.bytes_tol, d.gated),
                  _delta_cell(d.peak, True, False, opts.bytes_tol, d.gated),
                  _time_cell(d.time, d.gated) if d.status not in ("new", "missing") else "—",
                  _status_cell(d))
    return t
