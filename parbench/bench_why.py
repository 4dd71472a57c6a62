"""Why ours is slower than a framework on a pair, from what the two sides' runs measured
(issue 24: "every ratio <= 1.00x or the reason stated").

On shared cores a step's wall time is its ranks' CPU. Each run splits its CPU per timed step
into the calling thread's (the scheme's own work) and the other threads' by name (the
collective backend's: ``parbench.thread_cpu``), and its ledger counts the collectives'
calls and wire bytes per step. A pair where ours is slower, yet does less work itself and
issues the same collectives, loses its time in the backend's threads and in waiting: that
is the measured reason printed (so with fewer calls or bytes than theirs). Where ours' own work
is more, or it issues more collectives, no excuse is made: the line says so.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field

#: thread ratios shown per pair: the backend threads with the most CPU on the baseline's side
TOP_THREADS = 2


@dataclass
class CpuSplit:
    """Ours / theirs, median over the repeats, of the calling thread's CPU per step (``own``)
    and of each backend thread's (``threads``, by name); whether the two sides' collectives
    per step are the same (calls and wire bytes, from the ledger) and the figures."""

    own: float | None = None
    threads: dict[str, float] = field(default_factory=dict)
    same_traffic: bool | None = None
    traffic: str = ""
    #: ours issued no more than theirs: calls and wire bytes per step each at most theirs
    no_more_traffic: bool | None = None


def _ratio(ours: list, theirs: list) -> float | None:
    r = [a / b for a, b in zip(ours, theirs) if a and b]
    return statistics.median(r) if r else None


def _threads(ours_rows: list, theirs_rows: list) -> dict[str, float]:
    """Per backend thread name (the busiest on the baseline's side first), ours / theirs."""
    def per(rows, name):
        return [getattr(r.time, "threads_cpu_s", {}).get(name) for r in rows]
    totals: dict[str, float] = {}
    for r in theirs_rows:
        for name, s in (getattr(r.time, "threads_cpu_s", None) or {}).items():
            totals[name] = totals.get(name, 0.0) + s
    out = {}
    for name in sorted(totals, key=totals.get, reverse=True)[:TOP_THREADS]:
        ratio = _ratio(per(ours_rows, name), per(theirs_rows, name))
        if ratio is not None:
            out[name] = ratio
    return out


def _traffic(row) -> tuple[int, float] | None:
    traffic = getattr(row, "traffic", None)
    if traffic is None or not traffic.calls:
        return None
    return sum(traffic.calls_max().values()), sum(traffic.wire_max().values())


def cpu_split(ours_rows: list, theirs_rows: list) -> CpuSplit:
    """The pair's split from its rows, repeat by repeat."""
    own = _ratio([getattr(r.time, "own_cpu_s", None) for r in ours_rows],
                 [getattr(r.time, "own_cpu_s", None) for r in theirs_rows])
    a = _traffic(ours_rows[0]) if ours_rows else None
    b = _traffic(theirs_rows[0]) if theirs_rows else None
    same, fewer, text = None, None, ""
    if a and b:
        same = a[0] == b[0] and abs(a[1] - b[1]) < 0.5
        fewer = a[0] <= b[0] and a[1] <= b[1] + 0.5
        text = (f"{a[0]} calls, {a[1] / 2**10:.1f} KiB a step" if same else
                f"ours {a[0]} calls, {a[1] / 2**10:.1f} KiB; theirs {b[0]} calls, "
                f"{b[1] / 2**10:.1f} KiB a step")
    return CpuSplit(own, _threads(ours_rows, theirs_rows), same, text, fewer)


def explain(split: CpuSplit | None) -> str:
    """The measured reason for a pair where ours is slower ('' where nothing was measured)."""
    if split is None or split.own is None:
        return ""
    if split.own > 1.0:
        return f"measured: ours' own thread does more work ({split.own:.2f}x theirs' CPU)"
    threads = ", ".join(f"{n} {r:.2f}x" for n, r in split.threads.items()) or "not measured"
    if split.no_more_traffic:
        which = "the same collectives" if split.same_traffic else "no more collectives"
        return (f"measured: ours' own thread {split.own:.2f}x theirs' CPU, {which} "
                f"({split.traffic}); the rest is the backend's threads ({threads}) and "
                f"waiting")
    return (f"measured: ours' own thread {split.own:.2f}x theirs' CPU; ours issues more "
            f"collectives ({split.traffic or 'not measured'})")


def backend_bound(split: CpuSplit | None) -> bool:
    """Ours does less work itself and issues no more collectives (calls, bytes) than theirs:
    the gap is the backend's."""
    return bool(split and split.own is not None and split.own <= 1.0
                and split.no_more_traffic)
