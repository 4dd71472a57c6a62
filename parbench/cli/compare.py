"""``parbench compare OLD NEW [key=value ...] [--json]``: two runs case by case, the CI gate.

OLD and NEW are results directories or ``results.jsonl`` files. Options: ``bytes_tol=0``
(relative increase of bytes and calls tolerated), ``time_tol=auto|0.2`` (the step time
ratio's threshold: from the repeated steps' noise, or fixed), ``ignore_time=true``,
``match=id|config`` (``config``: the same case configuration run by another scheme) and
``gate_baselines=true`` (a baseline's bytes, memory and time gate too, not only its
verdict). Exit status: 0 no regression, 1 a regression (each regressed row named on stderr,
one line), 2 bad input. The logic is in ``parbench.report.compare``.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from ..config import ConfigError
from ..overrides import coerce, number
from .output import UsageError, console

OPTIONS = ("bytes_tol", "time_tol", "ignore_time", "match", "gate_baselines")
SYNTAX = ("compare OLD NEW [bytes_tol=0] [time_tol=auto|0.2] [ignore_time=true] "
          "[match=id|config] [gate_baselines=true] [--json]")


def parse_args(args: list[str]):
    """(old path, new path, Options) from the command line."""
    from ..report.compare import MATCHES, Options

    paths, opts = [], Options()
    for a in args:
        key, sep, value = a.partition("=")
        if not sep or (key not in OPTIONS and Path(a).exists()):
            paths.append(a)
            continue
        key, value = key.strip(), value.strip()
        if key == "bytes_tol":
            opts.bytes_tol = number(key, value, minimum=0)
        elif key == "time_tol":
            opts.time_tol = None if value.lower() == "auto" else number(key, value, minimum=0)
        elif key == "ignore_time":
            opts.ignore_time = coerce(value, bool, key)
        elif key == "gate_baselines":
            opts.gate_baselines = coerce(value, bool, key)
        elif key == "match":
            if value not in MATCHES:
                raise ConfigError(f"match={value!r} must be one of {', '.join(MATCHES)}")
            opts.match = value
        else:
            raise ConfigError(f"unknown key {key!r} for compare (use {', '.join(OPTIONS)})")
    if len(paths) != 2:
        raise UsageError(f"compare needs two results directories or files: parbench {SYNTAX}"
                         f" (got {len(paths)})")
    return paths[0], paths[1], opts


def cmd_compare(args: list[str], as_json: bool = False, wide: bool = False) -> int:
    from ..report.compare import compare_rows, read_rows
    from ..report.compare_table import regression_line, table

    old_path, new_path, opts = parse_args(args)
    old = read_rows(old_path, "OLD")
    new = read_rows(new_path, "NEW")
    diffs = compare_rows(old, new, opts)
    regressed = [d for d in diffs if d.regression]
    if as_json:
        print(json.dumps([d.to_dict() for d in diffs], indent=2, sort_keys=True,
                         default=str))
    else:
        out = console()
        out.print(table(diffs, old_path, new_path, opts))
        matched = sum(d.status not in ("new", "missing") for d in diffs)
        n_new = sum(d.status == "new" for d in diffs)
        missing = sum(d.status == "missing" for d in diffs)
        out.print(f"{matched} case(s) matched, {n_new} new, {missing} missing, "
                  f"{len(regressed)} regression(s)", highlight=False)
    for d in regressed:
        sys.stderr.write(f"parbench: regression: {regression_line(d)}\n")
    return 1 if regressed else 0
