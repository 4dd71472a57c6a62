"""The pipeline part of the time model: the schedule simulated with per-stage costs (cached
per schedule, p, m, v and normalised costs), or the 1F1B closed form for very long runs."""
from __future__ import annotations

from functools import lru_cache
import math

from .costs import _Costs
from .layout import Layout, splits_backward
from .profile import Profile


# ---------------------------------------------------------------------------------------
# pipeline
# ---------------------------------------------------------------------------------------

def _sig(x: float, digits: int = 3) -> float:
    if x == 0 or not math.isfinite(x):
        return x
    return round(x, digits - 1 - int(math.floor(math.log10(abs(x)))))


@lru_cache(maxsize=512)
def _schedule(name: str, p: int, m: int, v: int):
    from ..schedules import make_schedule
    return make_schedule(name, p, m, v if v > 1 else None)


@lru_cache(maxsize=4096)
def _simulate(name: str, p: int, m: int, v: int, tf: tuple, tb: tuple, tw: tuple,
              p2p: float) -> tuple[float, tuple[float, ...]]:
    """(makespan, busy per rank) of schedule ``name`` with per-virtual-stage costs."""
    from ..schedules import simulate
    sched = _schedule(name, p, m, v)
    split = splits_backward(name)
    stages = len(tf)

    def per(vals):
        return {i: vals[i] for i in range(stages)}

    if split:
        res = simulate(sched, tf=per(tf), tb=per(tb), tw=per(tw), p2p=p2p)
    else:
        res = simulate(sched, tf=per(tf), tb=per(tb), tw=per(tw),
                       tbw=per(tuple(x + y for x, y in zip(tb, tw))), p2p=p2p)
    return res.makespan, tuple(res.busy)


def _stage_map(name: str, p: int, v: int) -> int:
    """Virtual stages of the schedule: p v (v chunks per rank; bidirectional schedules with
    v = 1 still have p stages per pipe)."""
    return p * v


def pipeline_time(shape, lay: Layout, profile: Profile, stage_costs: list[_Costs],
                  p2p_s: float) -> tuple[float, float, list[float]]:
    """(makespan, makespan without p2p latency, busy per rank) of the schedule, simulated
    with normalised costs (cached), or in closed form for very long schedules."""
    p, m, v = lay.pp, lay.num_microbatches, lay.vpp
    name = lay.schedule
    tf = [c.tf for c in stage_costs]
    tb = [c.tb for c in stage_costs]
    tw = [c.w for c in stage_costs]
    if not splits_backward(name):
        tb = [x + y for x, y in zip(tb, tw)]
        tw = [0.0] * len(tw)
    unit = max(sum(tf) / len(tf), 1e-12)
    if p * m * v > 20000:
        # closed form (GPipe / 1F1B, PTD-P Sec. 2.2): the busiest rank's work plus the fill
        # and drain of p - 1 chunks, and the p2p latency of the fill and the drain
        per = [a + b + w for a, b, w in zip(tf, tb, tw)]
        busy = [m * sum(per[r::p]) for r in range(p)]
        comp = max(busy) + (p - 1) * sum(per) / len(per)
        return comp + 2 * (p - 1) * p2p_s, comp, busy
    # long schedules: 2 significant figures (a few % per stage cost) keep the number of
    # distinct simulations a planner needs small; short ones: 3
    digits = 2 if p * m * v > 256 else 3
    key = lambda xs: tuple(_sig(x / unit, digits) for x in xs)  # noqa: E731
    kf, kb, kw = key(tf), key(tb), key(tw)
    q = _sig(p2p_s / unit, digits) if p2p_s / unit > 1e-3 else 0.0
    ms, busy = _simulate(name, p, m, v, kf, kb, kw, q)
    ms0, _ = _simulate(name, p, m, v, kf, kb, kw, 0.0) if q else (ms, busy)
    return ms * unit, ms0 * unit, [x * unit for x in busy]


#: schedules whose ranks hold virtual stages r, r + p, ... of one pipe, every micro-batch
#: passing each stage once (what ``busy_bound`` assumes)
_LOOPED = frozenset(("gpipe", "1f1b", "interleaved", "bfs", "zb-h1", "zb-h2", "pipedream",
                     "2bw"))


#: rank r holds stages r and 2p - 1 - r (the V shapes)
_V = frozenset(("zbv", "dualpipev"))
#: two pipes, m / 2 micro-batches each: rank r holds stage r of one and p - 1 - r of the other
_TWO_PIPES = frozenset(("chimera", "dualpipe"))


def busy_bound(lay: Layout, stage_costs: list[_Costs]) -> list[float] | None:
    """Each rank's busy time (its actions' costs, no waiting), a lower bound of any
    schedule's makespan; None for a schedule whose placement is not listed here."""
    p, m = lay.pp, lay.num_microbatches
    per = [c.tf + c.tb + c.w for c in stage_costs]
    if lay.schedule in _LOOPED:
        return [m * sum(per[r::p]) for r in range(p)]
    if lay.schedule in _V and len(per) == 2 * p:
        return [m * (per[r] + per[2 * p - 1 - r]) for r in range(p)]
    if lay.schedule in _TWO_PIPES and len(per) == p:
        return [m / 2 * (per[r] + per[p - 1 - r]) for r in range(p)]
    return None

