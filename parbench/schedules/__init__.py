"""Pipeline schedules as data, one validator, one discrete-event simulator.

Each schedule is one generator registered with its metadata (`ScheduleSpec`, see
``spec.py``); ``SCHEDULES`` maps names to specs.

    >>> from parbench.schedules import make_schedule, validate, simulate
    >>> s = validate(make_schedule("1f1b", p=4, m=8))
    >>> round(simulate(s).bubble, 4)   # (p-1)/(m+p-1)
    0.2727
"""
from .actions import (
    KINDS,
    P2P_KINDS,
    Action,
    ActionKind,
    P2PTransfer,
    Schedule,
    ScheduleError,
    parse_row,
    row_text,
)
from .closed_forms import ClosedForm, ratio_from_fraction, ratio_from_size
from .continuous import (
    CONTINUOUS,
    continuous_schedule,
    relabel,
    steady_closed_form,
    steady_step,
    step_bounds,
)
from .registry import (
    SCHEDULES,
    closed_form,
    get_spec,
    make_schedule,
    max_inflight,
    paper_closed_form,
)
from .render import (
    GridEvent,
    TimelinePanel,
    events_from_sim,
    grid_text,
    plot_timeline,
    summary,
)
from .simulate import SimResult, make_cost, simulate
from .lower import Lowered, lower
from .lower_check import p2p_problems
from .spec import (
    UNIT_COSTS,
    ChunkRule,
    Costs,
    ExecutorKind,
    MinMicrobatches,
    Placement,
    Rows,
    ScheduleSpec,
    WeightRule,
    schedule_spec,
)
from .validate import fifo_violations, validate

__all__ = [
    "KINDS",
    "P2P_KINDS",
    "Action",
    "ActionKind",
    "parse_row",
    "row_text",
    "Lowered",
    "lower",
    "p2p_problems",
    "ExecutorKind",
    "WeightRule",
    "MinMicrobatches",
    "Rows",
    "Schedule",
    "ScheduleError",
    "P2PTransfer",
    "SCHEDULES",
    "ScheduleSpec",
    "ChunkRule",
    "Placement",
    "Costs",
    "UNIT_COSTS",
    "schedule_spec",
    "get_spec",
    "make_schedule",
    "SimResult",
    "make_cost",
    "simulate",
    "validate",
    "fifo_violations",
    "ClosedForm",
    "closed_form",
    "paper_closed_form",
    "max_inflight",
    "ratio_from_size",
    "ratio_from_fraction",
    "GridEvent",
    "TimelinePanel",
    "events_from_sim",
    "grid_text",
    "plot_timeline",
    "summary",
    "CONTINUOUS",
    "continuous_schedule",
    "step_bounds",
    "steady_step",
    "steady_closed_form",
    "relabel",
]
