"""``parbench schedule``: a pipeline schedule simulated (the fast simulator: p=64, m=1024 in
seconds), with its closed form, and drawn as a per-rank grid when it is small enough to
read."""
from __future__ import annotations

import json

from ..config import ConfigError
from ..overrides import coerce, number, parse_overrides


#: p * m * v * segments above which the grid is not drawn (unreadable); the figures are
#: still simulated and printed
MAX_SLOTS = 16384
#: p * m * v * segments above which the verb refuses (four times p=64, m=1024: seconds to
#: simulate; beyond, minutes and gigabytes)
MAX_SIMULATED = 262144


def cmd_schedule(args: list[str], as_json: bool = False, wide: bool = False) -> int:
    from ..schedules import SCHEDULES, ScheduleError, grid_text, make_schedule, simulate, summary
    from ..schedules import validate

    if not args or "=" in args[0]:
        raise ConfigError(f"schedule needs a NAME first (choose from {', '.join(SCHEDULES)})")
    name, rest = args[0], parse_overrides(args[1:])
    if name not in SCHEDULES:
        raise ConfigError(f"schedule={name!r} is not known (choose from "
                          f"{', '.join(SCHEDULES)})")
    ints = {k: number(k, rest.pop(k), integer=True, minimum=1)
            for k in ("p", "m", "v", "segments") if k in rest}
    costs = {k: number(k, rest.pop(k), minimum=0) for k in ("tf", "tb", "tw", "p2p") if k in rest}
    if "overlap" in rest:  # DualPipe: run each F&B pair as one unit (DeepSeek-V3 Table 2)
        costs["overlap"] = coerce(rest.pop("overlap"), bool, "overlap")
    size = ints.get("p", 4) * ints.get("m", 8) * ints.get("v", 1) * ints.get("segments", 1)
    if size > MAX_SIMULATED:
        raise ConfigError(f"p*m*v*segments={size} exceeds {MAX_SIMULATED}, the largest schedule "
                          f"this verb simulates (it draws the grid up to {MAX_SLOTS})")
    if rest:
        raise ConfigError(f"unknown key {next(iter(rest))!r} for schedule (p, m, v, tf, tb, tw, "
                          "p2p, overlap, segments)")
    # token slices per micro-batch (Seq1F1B, TeraPipe); only passed when given
    extra = {"segments": ints["segments"]} if "segments" in ints else {}
    try:
        schedule = validate(make_schedule(name, ints.get("p", 4), ints.get("m", 8),
                                          ints.get("v"), **extra))
        sim = simulate(schedule, **costs)
    except ScheduleError as e:
        raise ConfigError(str(e)) from None
    data = {**summary(schedule, sim), "description": SCHEDULES[name].description}
    if as_json:
        print(json.dumps(data, indent=2, default=str))
    else:
        if size <= MAX_SLOTS:
            print(grid_text(schedule, sim))
        else:
            print(f"(grid not drawn: p*m*v*segments={size} is above {MAX_SLOTS}; the figures "
                  "below are simulated in full)")
        for k, v in data.items():
            if not isinstance(v, (list, dict)):
                print(f"{k}: {v}")
            else:
                print(f"{k}: {json.dumps(v, default=str)}")
    return 0
