"""Discrete-event simulation of a pipeline schedule.

Each rank runs its action list strictly in order.  An action starts when its rank
is free and every dependency has finished — plus ``p2p`` latency when the
dependency ran on another rank (the transfer is not modelled as occupying either
rank).  Because ranks never reorder, start times are the longest paths of the DAG
"rank order + data dependencies", so the result is exact and deterministic.  A
rank whose next action waits on something that can never finish (a cycle, or a
dependency missing from the schedule) makes the simulation stall; that is how
the validator detects deadlocks.

Bubble ratio follows parbench's timeline definition:
``1 - sum(busy) / (p * makespan)``.

How it is fast (issue 12: 1F1B at p=64, m=1024 in well under a second, generation and
validation included): the schedule is first numbered (`_Plan`: every action an integer,
its dependencies looked up once, with numpy for the schedules the generators make), then
the worklist runs over plain lists of numbers (`_advance`), with the same steps, the same
order and the same float arithmetic as the action-by-action simulator it replaced, so
every time, every figure and the order of ``times`` are the ones that one gave (pinned
by ``tests/unit/test_simulator_fast.py``; ``scripts/bench_simulator.py`` times it).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from math import inf
from numbers import Real
from operator import itemgetter, sub
from typing import Callable, Mapping

import numpy as np

from .actions import Action, Schedule, ScheduleError
from .costs import make_cost  # noqa: F401  (make_cost is part of this module's API)
from .plan_form import _CODE_KIND, _Plan
from .sim_general import _general_unit
from .sim_peaks import _all_peaks


@dataclass
class SimResult:
    """Outcome of :func:`simulate`.

    times: ``action -> (start, end)``; idle: per rank, the ``(start, end)`` gaps in
    ``[0, makespan]``; peak_inflight: per rank, the most ``(mb, stage)`` forwards
    whose backward-for-inputs (B or BW) has not finished; peak_w_pending: per rank,
    the most finished B whose W has not finished; peak_held: per rank, the most
    ``(mb, stage)`` whose autograd graph an executor keeps -- from the forward until
    the fused BW or the W (a split backward keeps the graph between B and W); span: per rank, last end minus
    first start (the "parallelogram" width used by the Zero Bubble paper);
    params: the cost arguments the simulation ran with (scalars only).
    """

    schedule: Schedule
    makespan: float
    busy: list[float]
    bubble: float
    bubble_per_rank: list[float]
    peak_inflight: list[int]
    peak_w_pending: list[int]
    times: dict[Action, tuple[float, float]]
    idle: list[list[tuple[float, float]]]
    span: list[float] = field(default_factory=list)
    params: dict = field(default_factory=dict)
    peak_held: list[int] = field(default_factory=list)

    @property
    def p(self) -> int:
        return self.schedule.p

    @property
    def idle_time(self) -> list[float]:
        """Per-rank idle time inside ``[0, makespan]`` (the bubble *size*)."""
        return [self.makespan - b for b in self.busy]

    @property
    def span_bubble(self) -> float:
        """Largest per-rank idle time between that rank's own first start and last end.

        With the optimizer synchronisation bypassed (Qi et al. 2024, §4) iterations
        overlap and tile like parallelograms; this is then the steady-state bubble
        per iteration that the Zero Bubble paper's Table 2 counts.
        """
        return max(s - b for s, b in zip(self.span, self.busy))

    def order(self, rank: int) -> list[tuple[Action, float, float]]:
        """The actions of `rank` with their start and end times."""
        return [(a, *self.times[a]) for a in self.schedule.actions[rank]]


def _eager_costs(plan: _Plan, cost: Callable[[Action], float]) -> list[float] | None:
    """``float(cost(a))`` of every occurrence, or None when `cost` raises (the worklist then
    asks it action by action, so the error comes where it would have).

    A `make_cost` function without overrides depends on kind and stage alone: it is
    asked once per (kind, stage).
    """
    try:
        if not getattr(cost, "by_kind_and_stage", False):
            return [float(cost(a)) for a in plan.flat]
        if plan.regular:
            kind, stage = plan.numbers[0][:plan.n], plan.numbers[2][:plan.n]
            which = stage * 4 + kind
            table = np.zeros(plan.S * 4)
            for c in np.flatnonzero(np.bincount(which, minlength=len(table))).tolist():
                table[c] = float(cost(Action(_CODE_KIND[c % 4], 0, c // 4)))
            return table[which].tolist()
        pairs = [(kind, stage) for kind, _, stage, _ in plan.keys]
        memo = {ks: float(cost(Action(ks[0], 0, ks[1]))) for ks in set(pairs)}
        return list(map(memo.__getitem__, pairs))
    except Exception:
        return None


def _plain_costs(plan: _Plan, values: list[float] | None) -> list[float | None]:
    """Each occurrence's cost where `_advance`'s plain path may run it: a single action with
    a finite cost >= 0 known ahead; None for everything else (no eager costs, a cost to
    check, an overlapped pair, an occurrence of a non-regular plan not in its own slot)."""
    n = plan.n
    if values is None:
        plain: list[float | None] = [None] * n
    elif all(0.0 <= c < inf for c in set(values)):
        plain = list(values)
    else:
        plain = [c if 0.0 <= c < inf else None for c in values]
    for i in plan.pairs:
        plain[i] = None
    if not plan.regular:  # the plain path keeps occurrence i in slot i
        for i, u in enumerate(plan.slot):
            if u != i:
                plain[i] = None
    return plain


def _advance(plan: _Plan, cost: Callable[[Action], float], tfb=None):
    """The worklist of :func:`run_times` on `plan`.

    Returns ``(pos, starts, ends, done)``: each rank's next occurrence (its ``hi`` when
    it finished), the start and end shown for each occurrence, and the occurrences in
    the order they ran.  A unit is a single action with a finite cost >= 0 (the plain
    path below) or anything else (`general`, from ``sim_general``: overlapped pairs, costs
    to check or to ask for, split shares), which follows the original arithmetic step by step.
    """
    n, avail = plan.n, list(plan.avail)
    dep_a, dep_b, lag_a, lag_b = plan.dep_a, plan.dep_b, plan.lag_a, plan.lag_b
    values = _eager_costs(plan, cost)
    plain = _plain_costs(plan, values)
    p = plan.schedule.p
    pos, his = [lo for lo, _ in plan.bounds], [hi for _, hi in plan.bounds]
    free = [0.0] * p
    starts, ends, done = [0.0] * n, [0.0] * n, []
    waiting: dict[int, list[int]] = {}
    ready = deque(range(p))
    popleft, wake, record = ready.popleft, ready.extend, done.append
    general = _general_unit(plan, cost, tfb, values, avail, starts, ends, waiting, record, wake)
    while ready:
        rank = popleft()
        i, hi, t = pos[rank], his[rank], free[rank]
        while i < hi:
            c = plain[i]
            if c is None:
                step = general(rank, i, t)
                if step is None:
                    break
                i, t = step
                continue
            d = avail[dep_a[i]]
            if d is None:
                waiting.setdefault(dep_a[i], []).append(rank)
                break
            d += lag_a[i]
            start = d if d > t else t  # max(t, d), with max's own comparison
            d = avail[dep_b[i]]
            if d is None:
                waiting.setdefault(dep_b[i], []).append(rank)
                break
            d += lag_b[i]
            if d > start:
                start = d
            t = start + c
            starts[i] = start
            ends[i] = t
            avail[i] = t
            record(i)
            if i in waiting:
                wake(waiting.pop(i))
            i += 1
        pos[rank], free[rank] = i, t
    return pos, starts, ends, done


def _deadlock_free(plan: _Plan) -> bool:
    """Whether `_advance` on `plan` would finish, without its times: every action runs once
    its dependencies have run (an overlapped unit: those of both halves).  Where nothing
    is listed twice (as in a validated schedule), what runs does not depend on the order
    the ranks take turns in, so this is `_advance`'s verdict at well under half its cost."""
    ran = [t is not None for t in plan.avail]
    dep_a, dep_b, pairs = plan.dep_a, plan.dep_b, plan.pairs
    pos, his = [lo for lo, _ in plan.bounds], [hi for _, hi in plan.bounds]
    waiting: dict[int, list[int]] = {}
    ready = deque(range(plan.schedule.p))
    popleft, wake = ready.popleft, ready.extend
    while ready:
        rank = popleft()
        i, hi = pos[rank], his[rank]
        while i < hi:
            if pairs and i in pairs:
                blocked = [d for d in (dep_a[i], dep_b[i], dep_a[i + 1], dep_b[i + 1])
                           if not ran[d]]
                if blocked:
                    waiting.setdefault(blocked[0], []).append(rank)
                    break
                ran[i] = True  # the first half; the second goes on below
                wake(waiting.pop(i, ()))
                i += 1
            elif not ran[dep_a[i]]:
                waiting.setdefault(dep_a[i], []).append(rank)
                break
            elif not ran[dep_b[i]]:
                waiting.setdefault(dep_b[i], []).append(rank)
                break
            ran[i] = True
            if i in waiting:
                wake(waiting.pop(i))
            i += 1
        pos[rank] = i
    return all(pos[r] >= his[r] for r in range(plan.schedule.p))


def run_times(
    schedule: Schedule,
    cost: Callable[[Action], float],
    p2p: float = 0.0,
    overlap: bool = False,
    tfb=None,
):
    """Start/end time of every action; raises `ScheduleError` if the ranks stall.

    Worklist algorithm: a rank advances until its next action waits on a
    dependency that has not finished; it is woken when that dependency finishes.
    With `overlap`, each pair in ``schedule.overlapped`` runs as one unit: it
    starts when the dependencies of both halves are met, lasts `tfb` (a number,
    or ``tfb(f, b)``; default ``cost(f) + cost(b)``), and both outputs become
    available when the unit ends.  Its time is shown split between the halves in
    proportion to their own costs.

    `cost` should depend on the action alone: it is asked for every action ahead of the
    run, in list order (a `make_cost` function without overrides: once per kind and
    stage), and only if that raises, again as the worklist reaches each action, so that
    an error comes where it always did.
    """
    return _times(_run(_Plan(schedule).link(p2p, overlap), cost, tfb))


def _run(plan: _Plan, cost: Callable[[Action], float], tfb=None):
    """`_advance`, raising the deadlock `ScheduleError` when a rank did not finish."""
    pos, starts, ends, done = _advance(plan, cost, tfb)
    stuck = [r for r in range(plan.schedule.p) if pos[r] < plan.bounds[r][1]]
    if stuck:
        schedule = plan.schedule
        rank_of = {}
        for rank, _, a in schedule.iter_actions():
            rank_of.setdefault(a, rank)
        at = [pos[r] - lo for r, (lo, _) in enumerate(plan.bounds)]
        raise ScheduleError(_deadlock_message(schedule, at, stuck, schedule.backward_kinds(),
                                              rank_of))
    return plan, starts, ends, done


def _times(run) -> dict[Action, tuple[float, float]]:
    """``action -> (start, end)`` in the order the actions ran (a repeated one: its last run)."""
    plan, starts, ends, done = run
    flat = plan.flat
    return {flat[i]: (starts[i], ends[i]) for i in done}


def _deadlock_message(schedule, pos, stuck, kinds, rank_of) -> str:
    parts = []
    for rank in stuck:
        action = schedule.actions[rank][pos[rank]]
        missing = [d for d in schedule.dependencies(action, kinds)]
        waits = []
        for dep in missing:
            where = rank_of.get(dep)
            if where is None:
                waits.append(f"{dep} (not in the schedule)")
            elif pos[where] <= schedule.actions[where].index(dep):
                waits.append(f"{dep} (rank {where})")
        parts.append(f"rank {rank} at {action} waits for {', '.join(waits) or '?'}")
    return f"{schedule.name}: deadlock — " + "; ".join(parts)


#: per kind: (order, d_inflight, d_wpending, d_held) of its event; ends (order 0) sort first
def _gaps(starts: list[float], ends: list[float], makespan: float) -> list[tuple[float, float]]:
    """One rank's idle ``(start, end)`` gaps in ``[0, makespan]``: before each action that
    starts after everything before it on the rank ended, and after the last."""
    gaps, cursor = [], 0.0
    reach = np.array(ends, float)
    if len(reach) and set(map(type, ends)) == {float} and not (
            np.isnan(reach).any() or np.signbit(reach).any()):
        # the running end as the loop below keeps it: no NaN to skip, no -0.0 to keep, and
        # plain floats only (a latency given as a numpy float makes numpy floats of times)
        reach = np.maximum.accumulate(np.concatenate(([0.0], reach))).tolist()
        after = np.flatnonzero(np.array(starts, float) > reach[:-1]).tolist()
        gaps = [(reach[k], starts[k]) for k in after]
        cursor = reach[-1]
    else:
        for start, end in zip(starts, ends):
            if start > cursor:
                gaps.append((cursor, start))
            if end > cursor:  # max(cursor, end)
                cursor = end
    if makespan > cursor:
        gaps.append((cursor, makespan))
    return gaps


def simulate(
    schedule: Schedule,
    tf=1.0,
    tb=1.0,
    tw=1.0,
    p2p: float = 0.0,
    tbw=None,
    cost: Callable[[Action], float] | None = None,
    costs: Mapping[Action, float] | None = None,
    overlap: bool = False,
    tfb=None,
) -> SimResult:
    """Simulate `schedule` and return a :class:`SimResult`.

    tf, tb, tw, tbw: per-kind cost — a number, a per-stage sequence or a
    ``{stage: t}`` dict; fused BW costs `tbw` if given, else ``tb + tw``.
    cost: a callable ``cost(action) -> float`` used instead of the per-kind values.
    costs: ``{action: t}`` overriding both (e.g. measured per-op costs to replay).
    p2p: latency added to every cross-rank dependency.
    overlap: run the pairs in ``schedule.overlapped`` (DualPipe's F&B chunks) as
    one unit of duration `tfb` (default: the sum of the two costs).
    """
    cost_fn = make_cost(tf, tb, tw, tbw, cost, costs)
    run = _run(_Plan(schedule).link(p2p, overlap), cost_fn, tfb)
    plan, starts, ends, _ = run
    times = _times(run)
    if not plan.unique:  # a repeated action shows its last run everywhere, as `times` does
        starts = [times[a][0] for a in plan.flat]
        ends = [times[a][1] for a in plan.flat]
    p = schedule.p
    makespan = max(map(itemgetter(1), times.values()), default=0.0)
    busy, idle, span = [], [], []
    for rank in range(p):
        lo, hi = plan.bounds[rank]
        first, last = starts[lo:hi], ends[lo:hi]
        busy.append(sum(map(sub, last, first)))
        idle.append(_gaps(first, last, makespan))
        span.append(last[-1] - first[0] if hi > lo else 0.0)
    peak_i, peak_w, peak_h = (column[:p] for column in _all_peaks(plan, starts, ends))
    if makespan > 0:
        bubble = 1.0 - sum(busy) / (p * makespan)
        per_rank = [1.0 - b / makespan for b in busy]
    else:
        bubble, per_rank = 0.0, [0.0] * p
    params = {"tf": tf, "tb": tb, "tw": tw, "tbw": tbw, "p2p": p2p, "overlap": overlap, "tfb": tfb}
    params = {k: val for k, val in params.items() if val is None or isinstance(val, (Real, bool))}
    if cost is not None or costs is not None:
        params["custom_costs"] = True
    return SimResult(schedule, makespan, busy, bubble, per_rank, peak_i, peak_w, times, idle,
                     span, params, peak_h)
