"""Name -> generator registry.  Every generator is ``gen(p, m, v=None, **kw) -> Schedule``.

``v=None`` asks for the schedule's natural number of chunks per rank (1 for
single-stage schedules, 2 for interleaved / bfs / zbv / dualpipev); a `v` the
schedule cannot use raises `ScheduleError`.
"""
from __future__ import annotations

from typing import Callable

from .actions import Schedule, ScheduleError
from .basic import gpipe, one_f_one_b, pipedream, pipedream_2bw
from .bidirectional import chimera, dualpipe, dualpipev
from .looped import interleaved, looped_bfs
from .zero_bubble import zb_h1, zb_h2, zbv

Generator = Callable[..., Schedule]

SCHEDULES: dict[str, Generator] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved,
    "zb-h1": zb_h1,
    "zb-h2": zb_h2,
    "zbv": zbv,
    "chimera": chimera,
    "dualpipe": dualpipe,
    "dualpipev": dualpipev,
    "bfs": looped_bfs,
    "pipedream": pipedream,
    "2bw": pipedream_2bw,
}


def make_schedule(name: str, p: int, m: int, v: int | None = None, **kw) -> Schedule:
    """Build schedule `name`; unknown names raise `ScheduleError` listing the known ones."""
    try:
        gen = SCHEDULES[name]
    except KeyError:
        known = ", ".join(SCHEDULES)
        raise ScheduleError(f"unknown schedule name={name!r} (known: {known})") from None
    return gen(p, m, v, **kw)
