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
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from numbers import Real
from typing import Callable, Mapping, Sequence

from .actions import (
    BACKWARD_FULL,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    Action,
    Schedule,
    ScheduleError,
)


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


def _per_stage(value, stage: int, name: str) -> float:
    if isinstance(value, Real):
        return float(value)
    if isinstance(value, Mapping):
        return float(value[stage])
    if isinstance(value, Sequence):
        return float(value[stage])
    raise ScheduleError(f"{name} must be a number, a per-stage sequence or a dict (got {value!r})")


def make_cost(
    tf=1.0,
    tb=1.0,
    tw=1.0,
    tbw=None,
    cost: Callable[[Action], float] | None = None,
    costs: Mapping[Action, float] | None = None,
) -> Callable[[Action], float]:
    """Build ``cost(action) -> float``.

    Precedence: the `costs` override (e.g. measured per-op costs), then the `cost`
    callable, then per-kind values — each a number, a per-stage sequence or a
    ``{stage: t}`` dict.  A fused ``BW`` costs `tbw` when given, else ``tb + tw``.
    """

    def resolve(action: Action) -> float:
        if costs is not None and action in costs:
            return float(costs[action])
        if cost is not None:
            return float(cost(action))
        s = action.stage
        if action.kind == FORWARD:
            return _per_stage(tf, s, "tf")
        if action.kind == BACKWARD_INPUT:
            return _per_stage(tb, s, "tb")
        if action.kind == BACKWARD_WEIGHT:
            return _per_stage(tw, s, "tw")
        if action.kind == BACKWARD_FULL:
            if tbw is not None:
                return _per_stage(tbw, s, "tbw")
            return _per_stage(tb, s, "tb") + _per_stage(tw, s, "tw")
        raise ScheduleError(f"unknown action kind {action.kind!r} in {action}")

    return resolve


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
    """
    kinds = schedule.backward_kinds()
    partner = dict(schedule.overlapped) if overlap else {}
    rank_of = {}
    for rank, _, a in schedule.iter_actions():
        rank_of.setdefault(a, rank)
    pos = [0] * schedule.p
    free = [0.0] * schedule.p
    times: dict[Action, tuple[float, float]] = {}
    # a window of a longer run: what ran before it is available from the start
    avail: dict[Action, float] = {a: 0.0 for a in schedule.done_before}
    waiting: dict[Action, list[int]] = {}
    ready = deque(range(schedule.p))
    while ready:
        rank = ready.popleft()
        row = schedule.actions[rank]
        while pos[rank] < len(row):
            group = [row[pos[rank]]]
            mate = partner.get(group[0])
            if mate is not None and pos[rank] + 1 < len(row) and row[pos[rank] + 1] == mate:
                group.append(mate)
            start = free[rank]
            blocked = None
            for action in group:
                for dep in schedule.dependencies(action, kinds):
                    if dep in group:
                        continue
                    done = avail.get(dep)
                    if done is None:
                        blocked = dep
                        break
                    lag = p2p if rank_of.get(dep, rank) != rank else 0.0
                    start = max(start, done + lag)
                if blocked is not None:
                    break
            if blocked is not None:
                waiting.setdefault(blocked, []).append(rank)
                break
            costs = [float(cost(a)) for a in group]
            for a, c in zip(group, costs):
                if c < 0:
                    raise ScheduleError(f"cost of {a} must be >= 0 (got {c})")
            if len(group) == 1:
                duration = costs[0]
            elif tfb is None:
                duration = sum(costs)
            elif callable(tfb):
                duration = float(tfb(*group))
            else:
                duration = float(tfb)
            total, cursor = sum(costs), start
            for a, c in zip(group, costs):
                share = duration * (c / total if total > 0 else 1 / len(group))
                times[a] = (cursor, cursor + share)
                cursor += share
            end = start + duration
            free[rank] = end
            pos[rank] += len(group)
            for a in group:
                avail[a] = end
                ready.extend(waiting.pop(a, ()))
    stuck = [r for r in range(schedule.p) if pos[r] < len(schedule.actions[r])]
    if stuck:
        raise ScheduleError(_deadlock_message(schedule, pos, stuck, kinds, rank_of))
    return times


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


def _peaks(row: list[Action], times) -> tuple[int, int, int]:
    """Peak in-flight activations, peak pending W and peak held graphs on one rank.

    In a window of a longer run (``Schedule.done_before``) the micro-batches whose forward
    ran before the window and whose backward is in it count from the start.
    """
    events = []  # (time, order, d_inflight, d_wpending, d_held); ends (order 0) first
    forwards = {(a.mb, a.stage, a.pipe) for a in row if a.kind == FORWARD}
    carried_i = {(a.mb, a.stage, a.pipe) for a in row if a.kind in (BACKWARD_FULL,
                                                                     BACKWARD_INPUT)}
    carried_h = {(a.mb, a.stage, a.pipe) for a in row if a.kind in (BACKWARD_FULL,
                                                                     BACKWARD_WEIGHT)}
    for a in row:
        start, end = times[a]
        if a.kind == FORWARD:
            events.append((start, 1, 1, 0, 1))
        elif a.kind == BACKWARD_FULL:
            events.append((end, 0, -1, 0, -1))
        elif a.kind == BACKWARD_INPUT:
            events.append((end, 0, -1, 1, 0))
        elif a.kind == BACKWARD_WEIGHT:
            events.append((end, 0, 0, -1, -1))
    inflight, held = len(carried_i - forwards), len(carried_h - forwards)
    pending, peak_i, peak_w, peak_h = 0, inflight, 0, held
    for _, _, di, dw, dh in sorted(events):
        inflight += di
        pending += dw
        held += dh
        peak_i = max(peak_i, inflight)
        peak_w = max(peak_w, pending)
        peak_h = max(peak_h, held)
    return peak_i, peak_w, peak_h


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
    times = run_times(schedule, cost_fn, p2p, overlap, tfb)
    p = schedule.p
    makespan = max((end for _, end in times.values()), default=0.0)
    busy, idle, span, peak_i, peak_w, peak_h = [], [], [], [], [], []
    for rank in range(p):
        row = schedule.actions[rank]
        busy.append(sum(times[a][1] - times[a][0] for a in row))
        gaps, cursor = [], 0.0
        for a in row:
            start, end = times[a]
            if start > cursor:
                gaps.append((cursor, start))
            cursor = max(cursor, end)
        if makespan > cursor:
            gaps.append((cursor, makespan))
        idle.append(gaps)
        span.append(times[row[-1]][1] - times[row[0]][0] if row else 0.0)
        pi, pw, ph = _peaks(row, times)
        peak_i.append(pi)
        peak_w.append(pw)
        peak_h.append(ph)
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
