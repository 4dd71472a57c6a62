"""The simulator's general path: the units `_advance`'s plain path does not run -- an
overlapped pair (DualPipe's F&B chunks, one unit of duration `tfb`), a cost to ask for as the
worklist reaches it or to check -- with the same steps and float arithmetic as the
action-by-action simulator (``simulate``'s module doc)."""
from __future__ import annotations

from typing import Callable

from .actions import Action, ScheduleError
from .plan_form import _Plan


def _general_unit(plan: _Plan, cost: Callable[[Action], float], tfb, values, avail, starts,
                  ends, waiting, record, wake):
    """`_advance`'s path for everything but a plain unit, over its state: ``general(rank,
    i, start)`` runs the unit at occurrence i from `start` and returns its next occurrence
    and end, or None when blocked (`rank` then waits on the missing dependency)."""
    flat, slot, pairs = plan.flat, plan.slot, plan.pairs
    dep_a, dep_b, lag_a, lag_b = plan.dep_a, plan.dep_b, plan.lag_a, plan.lag_b

    def general(rank: int, i: int, start: float):
        group = (i, i + 1) if i in pairs else (i,)
        for j in group:
            for d, lag in ((dep_a[j], lag_a[j]), (dep_b[j], lag_b[j])):
                t = avail[d]
                if t is None:
                    waiting.setdefault(d, []).append(rank)
                    return None
                start = max(start, t + lag)
        costs = [values[j] for j in group] if values is not None else \
            [float(cost(flat[j])) for j in group]
        for j, c in zip(group, costs):
            if c < 0:
                raise ScheduleError(f"cost of {flat[j]} must be >= 0 (got {c})")
        duration = _unit_duration(flat, group, costs, tfb)
        total, cursor = sum(costs), start
        for j, c in zip(group, costs):
            share = duration * (c / total if total > 0 else 1 / len(group))
            starts[j], ends[j] = cursor, cursor + share
            cursor += share
        end = start + duration
        for j in group:
            avail[slot[j]] = end
            record(j)
            wake(waiting.pop(slot[j], ()))
        return group[-1] + 1, end

    return general


def _unit_duration(flat, group: tuple[int, ...], costs: list[float], tfb) -> float:
    """A unit's duration: its one action's cost; an overlapped pair's `tfb` (a number, or
    ``tfb(f, b)``), the sum of its costs without one."""
    if len(group) == 1:
        return costs[0]
    if tfb is None:
        return sum(costs)
    if callable(tfb):
        return float(tfb(*(flat[j] for j in group)))
    return float(tfb)
