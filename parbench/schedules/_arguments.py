"""Argument checks shared by the generators (messages name field, value and rule)."""
from __future__ import annotations

from .actions import ScheduleError


def need_positive(name: str, **values: int) -> None:
    for field, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ScheduleError(f"{name} needs a positive integer {field} (got {field}={value!r})")


def resolve_v(name: str, v: int | None, default: int, allowed=None, minimum=None) -> int:
    """`v=None` means the schedule's natural number of chunks per rank."""
    if v is None:
        return default
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ScheduleError(f"{name} needs a positive integer v (got v={v!r})")
    if allowed is not None and v not in allowed:
        rule = " or ".join(f"v={a}" for a in allowed)
        raise ScheduleError(f"{name} needs {rule} (got v={v})")
    if minimum is not None and v < minimum:
        raise ScheduleError(f"{name} needs v >= {minimum} (got v={v})")
    return v


def need_even_p(name: str, p: int) -> None:
    if p % 2:
        raise ScheduleError(f"{name} needs an even p (got p={p})")


def no_extra(name: str, kw: dict) -> None:
    if kw:
        given = ", ".join(f"{k}={v!r}" for k, v in sorted(kw.items()))
        raise ScheduleError(f"{name} takes no option {given} (options: p, m, v)")
