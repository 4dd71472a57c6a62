"""``parbench compare OLD NEW [key=value ...] [--json]``: two runs case by case, the CI gate.

OLD and NEW are results directories or ``results.jsonl`` files, or both the JSON files of
``scripts/bench_all.py --json`` (pairs matched by kind, label and case; the rules in
``parbench.report.bench_compare``; only ``time_tol`` and ``ignore_time`` apply). Options for
rows: ``bytes_tol=0`` (relative increase of bytes and calls tolerated), ``time_tol=auto|0.2``
(the step time ratio's threshold: from the repeated steps' noise, or fixed),
``ignore_time=true``, ``match=id|config`` (``config``: the same case configuration run by
another scheme) and ``gate_baselines=true`` (a baseline's bytes, memory and time gate too,
not only its verdict). Exit status: 0 no regression, 1 a regression (each regressed row named
on stderr, one line), 2 bad input (a bench_all file beside results rows too). The logic is in
``parbench.report.compare``.
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
        raise UsageError(f"compare needs two results directories or files (or two bench_all "
                         f"JSON files): parbench {SYNTAX}"
                         f" (got {len(paths)})")
    return paths[0], paths[1], opts


def cmd_compare(args: list[str], as_json: bool = False, wide: bool = False) -> int:
    from ..report.bench_compare import is_bench_file

    old_path, new_path, opts = parse_args(args)
    bench = [is_bench_file(old_path), is_bench_file(new_path)]
    if all(bench):
        return _compare_bench(old_path, new_path, opts, as_json)
    if any(bench):
        _mixed(old_path, new_path, bench)
    from ..report.compare import compare_rows, read_rows
    from ..report.compare_table import table

    diffs = compare_rows(read_rows(old_path, "OLD"), read_rows(new_path, "NEW"), opts)
    return _report(diffs, as_json, lambda: table(diffs, old_path, new_path, opts), "case")


def _compare_bench(old_path: str, new_path: str, opts, as_json: bool) -> int:
    """Two ``scripts/bench_all.py --json`` files (``parbench.report.bench_compare``)."""
    from ..report.bench_compare import compare_pairs, read_pairs
    from ..report.bench_compare_table import table

    diffs = compare_pairs(read_pairs(old_path, "OLD"), read_pairs(new_path, "NEW"), opts)
    return _report(diffs, as_json, lambda: table(diffs, old_path, new_path), "pair")


def _mixed(old_path: str, new_path: str, bench: list[bool]) -> None:
    """One bench_all JSON file and one results directory or file: a ConfigError naming both
    (after each path's own check: a malformed list or a path that does not exist says so)."""
    from ..report.bench_compare import read_pairs
    from ..report.result_files import results_path

    sides = [("OLD", old_path, bench[0]), ("NEW", new_path, bench[1])]
    ((b_what, b_path),) = [(w, p) for w, p, is_bench in sides if is_bench]
    ((r_what, r_path),) = [(w, p) for w, p, is_bench in sides if not is_bench]
    read_pairs(b_path, b_what)
    results_path(r_path, r_what)
    raise ConfigError(f"{b_what}={b_path} is bench_all's JSON (a list of pairs) but "
                      f"{r_what}={r_path} is a results directory or rows file: compare two "
                      "bench_all files or two results directories")


def _report(diffs: list, as_json: bool, render, what: str) -> int:
    """Print the diffs (JSON, or the table and a count), one stderr line per regression;
    the exit status."""
    from ..report.compare_table import regression_line

    regressed = [d for d in diffs if d.regression]
    if as_json:
        print(json.dumps([d.to_dict() for d in diffs], indent=2, sort_keys=True,
                         default=str))
    else:
        out = console()
        out.print(render())
        matched = sum(d.status not in ("new", "missing") for d in diffs)
        n_new = sum(d.status == "new" for d in diffs)
        missing = sum(d.status == "missing" for d in diffs)
        out.print(f"{matched} {what}(s) matched, {n_new} new, {missing} missing, "
                  f"{len(regressed)} regression(s)", highlight=False)
    for d in regressed:
        sys.stderr.write(f"parbench: regression: {regression_line(d)}\n")
    return 1 if regressed else 0
