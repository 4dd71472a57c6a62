"""Pipeline schedules as data, one validator, one discrete-event simulator.

    >>> from parbench.schedules import make_schedule, validate, simulate
    >>> s = validate(make_schedule("1f1b", p=4, m=8))
    >>> round(simulate(s).bubble, 4)   # (p-1)/(m+p-1)
    0.2727
"""
from .actions import (
    KINDS,
    Action,
    Schedule,
    ScheduleError,
    Transfer,
)
from .closed_forms import predict, ratio_from_fraction, ratio_from_size
from .registry import SCHEDULES, make_schedule
from .render import Event, events_from_sim, grid_text, plot_timeline, summary
from .simulate import SimResult, make_cost, simulate
from .validate import fifo_violations, validate

__all__ = [
    "KINDS",
    "Action",
    "Schedule",
    "ScheduleError",
    "Transfer",
    "SCHEDULES",
    "make_schedule",
    "SimResult",
    "make_cost",
    "simulate",
    "validate",
    "fifo_violations",
    "predict",
    "ratio_from_size",
    "ratio_from_fraction",
    "Event",
    "events_from_sim",
    "grid_text",
    "plot_timeline",
    "summary",
]
