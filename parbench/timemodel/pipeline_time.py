"""The pipeline part of the time model: the schedule simulated with per-stage costs (cached
per schedule, p, m, v and normalised costs), or the 1F1B closed form for very long runs."""
from __future__ import annotations

import math
from functools import lru_cache

from .. import schedules  # schedules.simulate read at call time: tests count the calls
from ..schedules import get_spec, make_schedule
from .costs import _Costs
from .training import Training
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
    return make_schedule(name, p, m, v if v > 1 else None)


@lru_cache(maxsize=4096)
def _simulate(name: str, p: int, m: int, v: int, tf: tuple, tb: tuple, tw: tuple,
              p2p: float) -> tuple[float, tuple[float, ...]]:
    """(makespan, busy per rank) of schedule ``name`` with per-virtual-stage costs."""
    sched = _schedule(name, p, m, v)
    split = get_spec(name).splits_backward
    stages = len(tf)

    def per(vals):
        return {i: vals[i] for i in range(stages)}

    if split:
        res = schedules.simulate(sched, tf=per(tf), tb=per(tb), tw=per(tw), p2p=p2p)
    else:
        res = schedules.simulate(sched, tf=per(tf), tb=per(tb), tw=per(tw),
                                 tbw=per(tuple(x + y for x, y in zip(tb, tw))), p2p=p2p)
    return res.makespan, tuple(res.busy)


def _stage_map(name: str, p: int, v: int) -> int:
    """Virtual stages of the schedule: p v (v chunks per rank; bidirectional schedules with
    v = 1 still have p stages per pipe)."""
    return p * v


def pipeline_time(shape, trn: Training, profile: Profile, stage_costs: list[_Costs],
                  p2p_s: float, bubble: bool = True) -> tuple[float, float, list[float]]:
    """(makespan, makespan without p2p latency, busy per rank) of the schedule, simulated
    with normalised costs (cached), or in closed form for very long schedules;
    ``bubble=False``: the makespan again instead of the one without p2p latency (one
    simulation instead of two, for a caller that reads the step alone)."""
    lay = trn.layout
    p, m, v = lay.pp, lay.num_microbatches, lay.vpp
    name = lay.schedule
    spec = priced_spec(name)
    tf = [c.tf for c in stage_costs]
    tb = [c.tb for c in stage_costs]
    tw = [c.w for c in stage_costs]
    if not spec.splits_backward:
        tb = [x + y for x, y in zip(tb, tw)]
        tw = [0.0] * len(tw)
    unit = max(sum(tf) / len(tf), 1e-12)
    if p * m * v > 20000:
        # closed form (GPipe / 1F1B, PTD-P Sec. 2.2): the busiest rank's work plus the fill
        # and drain of p - 1 chunks, and the p2p latency of the fill and the drain
        per = [a + b + w for a, b, w in zip(tf, tb, tw)]
        busy = _rank_work(spec, p, m, v, per) or [m * sum(per[r::p]) for r in range(p)]
        comp = max(busy) + (p - 1) * sum(per) / len(per)
        return comp + 2 * (p - 1) * p2p_s, comp, busy
    # long schedules: 2 significant figures (a few % per stage cost) keep the number of
    # distinct simulations a planner needs small; short ones: 3
    digits = 2 if p * m * v > 256 else 3
    key = lambda xs: tuple(_sig(x / unit, digits) for x in xs)  # noqa: E731
    kf, kb, kw = key(tf), key(tb), key(tw)
    q = _sig(p2p_s / unit, digits) if p2p_s / unit > 1e-3 else 0.0
    ms, busy = _simulate(name, p, m, v, kf, kb, kw, q)
    ms0, _ = _simulate(name, p, m, v, kf, kb, kw, 0.0) if q and bubble else (ms, busy)
    return ms * unit, ms0 * unit, [x * unit for x in busy]


def priced_spec(name: str):
    """The spec of schedule ``name``; ValueError naming it and why when the time model
    cannot price it (``ScheduleSpec.unpriced``)."""
    spec = get_spec(name)
    if not spec.priced:
        raise ValueError(f"schedule={name!r} is not priced by the time model: {spec.unpriced}")
    return spec


def _rank_work(spec, p: int, m: int, v: int, per: list[float]) -> list[float] | None:
    """Each rank's work: every stage it holds (the spec's placement) times the micro-batches
    of that stage's replica (m, or m / 2 for each of two replicas); None when ``per`` does
    not hold one cost per stage of the placement."""
    placement = spec.placement
    if len(per) != placement.num_stages(p, v):
        return None
    busy = [0.0] * p
    for (_, stage), rank in placement.ranks(p, v).items():
        busy[rank] += m / placement.pipes * per[stage]
    return busy


def busy_bound(trn: Training, stage_costs: list[_Costs]) -> list[float] | None:
    """Each rank's busy time (its actions' costs, no waiting), a lower bound of any
    schedule's makespan; None when the stage costs do not fit the schedule's placement."""
    lay = trn.layout
    per = [c.tf + c.tb + c.w for c in stage_costs]
    return _rank_work(priced_spec(lay.schedule), lay.pp, lay.num_microbatches, lay.vpp, per)


#: the chain bound's margin: the simulator rounds stage costs to 3 significant figures
CHAIN_MARGIN = 0.99


def chain_bound(trn: Training, stage_costs: list[_Costs], busy: list[float]) -> float:
    """A lower bound of any schedule's makespan tighter than the busiest rank: rank r can
    start no earlier than micro-batch 0's forward through the stages before its lowest
    one (the fill), and -- when its last action is a whole backward of its lowest stage
    (no split backward) -- the step cannot end before that backward has run back through
    those stages (the drain): makespan >= fill_r + busy_r + drain_r (the 1F1B makespan
    (p - 1)(t_f + t_b) + m (t_f + t_b) on the last rank, Narayanan et al. 2021, Sec. 2.2).
    Communication latency is left out, so it stays a bound; ``CHAIN_MARGIN`` covers the
    simulator's rounding. Two-pipe placements: the busiest rank only."""
    lay = trn.layout
    spec = priced_spec(lay.schedule)
    placement = spec.placement
    if placement.pipes != 1 or len(stage_costs) != placement.num_stages(lay.pp, lay.vpp):
        return max(busy)
    lowest = [len(stage_costs)] * lay.pp
    for (_, stage), rank in placement.ranks(lay.pp, lay.vpp).items():
        lowest[rank] = min(lowest[rank], stage)
    fill = [0.0]
    drain = [0.0]
    for c in stage_costs:
        fill.append(fill[-1] + c.tf)
        drain.append(drain[-1] + c.tb)
    tail = (lambda r: 0.0) if spec.splits_backward else (lambda r: drain[lowest[r]])
    return max(max(busy), CHAIN_MARGIN * max(fill[lowest[r]] + busy[r] + tail(r)
                                             for r in range(lay.pp)))
