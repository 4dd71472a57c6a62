"""Verbs that describe or read, spawning no rank: list, report, mesh, golden (and
``schedule``, in ``cli/schedule.py``)."""
from __future__ import annotations

import json
from pathlib import Path

from ..config import ConfigError
from ..overrides import number, parse_overrides
from .output import UsageError, console, emit


def cmd_list(args, as_json: bool = False, wide: bool = False) -> int:
    from ..config import PRESETS
    from ..registry import all_schemes
    from ..schedules import SCHEDULES
    from ..suites import available_suites

    if args:
        raise UsageError(f"list takes no arguments (got {' '.join(args)})")
    data = {"suites": {n: str(p) for n, p in available_suites().items()},
            "schemes": {n: {"family": c.family, "baseline_of": c.baseline_of,
                            "description": c.description} for n, c in all_schemes().items()},
            "schedules": sorted(SCHEDULES), "presets": PRESETS}

    def render(d):
        print("suites:    " + ", ".join(d["suites"]))
        print("schemes:")
        for n, c in d["schemes"].items():
            tag = f"  (baseline of {c['baseline_of']})" if c["baseline_of"] else ""
            print(f"  {n:34s} {c['family']:9s} {c['description']}{tag}")
        print("schedules: " + ", ".join(d["schedules"]))
        print("presets:   " + ", ".join(d["presets"]))

    emit(data, as_json, render)
    return 0


def cmd_report(args, as_json: bool = False, wide: bool = False) -> int:
    from ..report import print_tables, write_report
    from ..results import load_rows

    if len(args) != 1:
        raise UsageError("report needs one results directory: parbench report DIR [--wide]")
    d = Path(args[0])
    if not (d / "results.jsonl").exists():
        raise ConfigError(f"DIR={d} has no results.jsonl")
    rows = load_rows(d)
    if as_json:
        print(json.dumps([r.to_dict() for r in rows], indent=2, default=str))
    else:
        print_tables(rows, console(), wide=wide)
    write_report(rows, d)
    return 0


#: ranks above which ``mesh`` would print an unreadable listing
MAX_MESH = 4096


def cmd_mesh(args, as_json: bool = False, wide: bool = False) -> int:
    from ..layout import DENSE_ORDER, Layout

    from .help import own_keys

    names = own_keys("mesh")
    deg = {}
    for k, v in parse_overrides(args).items():
        if k not in names:
            raise ConfigError(f"unknown key {k!r} for mesh (use {', '.join(names)})")
        deg[k] = number(k, v, integer=True, minimum=1)
    layout = Layout(**deg)
    if layout.world_size > MAX_MESH:
        raise ConfigError(f"tp*cp*dp*pp={layout.world_size} exceeds {MAX_MESH}, the largest "
                          "mesh this verb lists rank by rank")
    data = layout.describe()

    def render(d):
        g = d["degrees"]
        print(f"world {d['world_size']} = tp {g['tp']} x cp {g['cp']} x dp {g['dp']} x "
              f"pp {g['pp']}  (ep {g['ep']} re-partitions tp x cp x dp; Megatron-Core order "
              "tp-cp-ep-dp-pp)")
        print("rank  " + "  ".join(f"{a:>3s}" for a in DENSE_ORDER))
        for r, c in d["ranks"].items():
            print(f"{r:4d}  " + "  ".join(f"{c[a]:3d}" for a in DENSE_ORDER))
        for name, groups in d["groups"].items():
            print(f"{name:9s} " + " ".join(str(g) for g in groups))

    emit(data, as_json, render)
    return 0


def uses_golden_run(case) -> bool:
    """The case is checked against the standard single-device golden run (schemes with a
    rule of their own -- local SGD, PipeDream -- simulate it and store nothing)."""
    from ..scheme import Scheme
    from ..registry import get_scheme
    return get_scheme(case.run.scheme).reference.__func__ is Scheme.reference.__func__


def cmd_golden(args, as_json: bool = False, wide: bool = False) -> int:
    """``golden record [suite=a,b] [dir=]``: the golden files of the suites' cases;
    ``golden check [dir=]``: hashes, stale tensors, a fresh run, the torch version."""
    from .. import golden
    from ..registry import routing_of
    from ..suites import available_suites, load_suite

    if not args or args[0] not in ("record", "check"):
        raise UsageError("golden needs record or check: parbench golden record|check "
                         "[dir=golden] [suite=NAME,...]")
    ov = parse_overrides(args[1:])
    directory = ov.pop("dir", golden.GOLDEN_DIR)
    if args[0] == "record":
        names = [n for n in ov.pop("suite", ",".join(available_suites())).split(",") if n]
        if ov:
            raise ConfigError(f"unknown key {next(iter(ov))!r} for golden record (use suite=, "
                              "dir=)")
        cases = [c for n in names for c in load_suite(n).cases if uses_golden_run(c)]
        written = golden.record(cases, directory, routing_of)
        emit(written, as_json,
             lambda d: print(f"recorded {len(d)} golden file(s) for {len(cases)} case(s) of "
                             f"{', '.join(names)} in {directory}"))
        return 0
    if ov:
        raise ConfigError(f"unknown key {next(iter(ov))!r} for golden check (use dir=)")
    if not Path(directory, "manifest.json").exists():
        raise ConfigError(f"dir={directory} has no manifest.json (run `parbench golden record`)")
    rows = golden.check(directory)

    def render(rs):
        for r in rs:
            notes = []
            if r.get("stale"):
                notes.append(f"{len(r['stale'])} stored tensor(s) no longer produced, e.g. "
                             f"{r['stale'][0]}")
            if r.get("new"):
                notes.append(f"{len(r['new'])} tensor(s) produced but not stored")
            if r.get("torch_changed_numbers"):
                notes.append(f"torch {r['torch_recorded']} -> {r['torch_now']} changes the "
                             "numbers")
            diff = "—" if r.get("max_abs") is None else f"{r['max_abs']:.1e}"
            print(f"{r['name']}  sha256 {'ok' if r['sha256_ok'] else 'MISMATCH'}  "
                  f"rerun max|d| {diff}  {'ok' if r['ok'] else 'FAIL'}"
                  + (f"  ({'; '.join(notes)})" if notes else ""))

    emit(rows, as_json, render)
    return 0 if all(r["ok"] for r in rows) else 1
