"""Name -> `ScheduleSpec`, built from the generators' own ``schedule_spec`` decorations.

Every generator is ``gen(p, m, v=None, **kw) -> Schedule``.  ``v=None`` asks for the
schedule's natural number of chunks per rank (1 for single-stage schedules, 2 for
interleaved / bfs / zbv / dualpipev); a `v` the schedule cannot use raises `ScheduleError`.
The closed-form bubble and the in-flight limit of a schedule are dispatched here, through
its spec, for every caller (``parbench schedule``, the pipeline table, the tests).
"""
from __future__ import annotations

# each generator module registers its schedules when imported, in this (listing) order
from . import basic, looped, zero_bubble, bidirectional  # noqa: F401  isort: skip
from . import wave, segments, bpipe  # noqa: F401  isort: skip
from .actions import Schedule, ScheduleError
from .closed_forms import ClosedForm
from .spec import Costs, ScheduleSpec, registered_specs

SCHEDULES: dict[str, ScheduleSpec] = registered_specs()


def get_spec(name: str) -> ScheduleSpec:
    """The spec of schedule `name`; unknown names raise `ScheduleError` listing the known ones."""
    try:
        return SCHEDULES[name]
    except KeyError:
        known = ", ".join(SCHEDULES)
        raise ScheduleError(f"unknown schedule name={name!r} (known: {known})") from None


def make_schedule(name: str, p: int, m: int, v: int | None = None, **kw) -> Schedule:
    """Build schedule `name`; unknown names raise `ScheduleError` listing the known ones."""
    return get_spec(name).build(p, m, v, **kw)


def closed_form(schedule: Schedule, tf: float = 1.0, tb: float = 1.0, tw: float = 1.0,
                overlap: bool = False) -> ClosedForm | None:
    """The paper's bubble of a generated `schedule` at scalar costs, in parbench's terms.

    None for schedules without a published closed form (or not from the registry).
    """
    spec = SCHEDULES.get(schedule.name)
    if spec is None or spec.closed_form is None:
        return None
    return spec.closed_form(schedule.p, schedule.m, schedule.v, tf, tb, tw, overlap)


def paper_closed_form(schedule: Schedule) -> tuple[ClosedForm | None, Costs]:
    """The closed form at the costs its paper states it for (``ScheduleSpec.paper_costs``),
    and those costs."""
    costs = get_spec(schedule.name).paper_costs
    return closed_form(schedule, **costs.as_kwargs()), costs


def max_inflight(name: str, p: int, m: int, rank: int = 0) -> int | None:
    """Peak micro-batches in flight (forward done, backward-for-inputs not) on `rank`, where
    the paper states one (None otherwise)."""
    bound = get_spec(name).max_inflight
    return None if bound is None else bound(p, m, rank)
