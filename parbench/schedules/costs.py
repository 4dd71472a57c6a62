"""Per-action costs for the simulator: ``make_cost`` turns the schedule costs (numbers, per
stage lists or mappings, a combined B+W cost) into the function ``simulate`` asks."""
from __future__ import annotations

from numbers import Real
from typing import Callable, Mapping, Sequence

from .actions import (BACKWARD_FULL, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, Action,
                      ScheduleError)


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

    resolve.by_kind_and_stage = costs is None and cost is None  # see `_eager_costs`
    return resolve
