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


def golden_cases(names: list[str] | None = None) -> dict[str, list]:
    """suite -> its cases checked against the standard golden run (all suites by default)."""
    from ..suites import available_suites, load_suite
    return {n: [c for c in load_suite(n).cases if uses_golden_run(c)]
            for n in (names or list(available_suites()))}


def cmd_golden(args, as_json: bool = False, wide: bool = False) -> int:
    """``golden record [suite=a,b] [keys=main|all] [dir=]``: the golden files of the suites'
    keys (``parbench.golden.select``); ``golden check [dir=]``: each file recomputed under
    the verdict's noise rule (``parbench.golden.check``), and the suite cases it serves."""
    from .. import golden

    if not args or args[0] not in ("record", "check"):
        raise UsageError("golden needs record or check: parbench golden record|check "
                         "[dir=golden] [suite=NAME,...] [keys=main|all]")
    ov = parse_overrides(args[1:])
    directory = ov.pop("dir", golden.GOLDEN_DIR)
    allowed = ("suite", "keys") if args[0] == "record" else ()
    for k in ov:
        if k not in allowed:
            raise ConfigError(f"unknown key {k!r} for golden {args[0]} (use "
                              f"{', '.join(f'{a}=' for a in (*allowed, 'dir'))})")
    if args[0] == "record":
        return _golden_record(directory, ov, as_json)
    if not Path(directory, "manifest.json").exists():
        raise ConfigError(f"dir={directory} has no manifest.json (run `parbench golden record`)")
    rows = golden.check(directory)
    serves = _served_cases(golden_cases()) if rows else {}
    for r in rows:
        r["serves"] = serves.get(r["name"], [])
    emit(rows, as_json, _render_check)
    return 0 if all(r["ok"] for r in rows) else 1


def _golden_record(directory: str, ov: dict, as_json: bool) -> int:
    from .. import golden
    from ..registry import routing_of
    names = [n for n in str(ov.get("suite", "")).split(",") if n] or None
    keys = str(ov.get("keys", "main"))
    if keys not in golden.SELECTIONS:
        raise ConfigError(f"keys={keys} must be main (each suite's most shared key) or all")
    by_suite = golden_cases(names)
    written = golden.record(golden.select_runs(by_suite, routing_of, keys), directory)
    total = sum(len(c) for c in by_suite.values())
    served = len({c for w in written for c in w["cases"]})
    emit(written, as_json, lambda d: print(
        f"recorded {len(d)} golden file(s), {sum(w['bytes'] for w in d) / 2**20:.2f} MiB, "
        f"serving {served} of {total} case(s) of {', '.join(by_suite)} in {directory}"))
    return 0


def _served_cases(by_suite: dict[str, list]) -> dict[str, list[str]]:
    """golden file name -> the suite cases (``suite/id``) whose key it holds."""
    from .. import golden
    from ..registry import routing_of
    out: dict[str, list[str]] = {}
    for w in golden.select_runs(by_suite, routing_of, "all"):
        out[golden.golden_name(w.key)] = w.cases
    return out


def _render_check(rows: list[dict]) -> None:
    for r in rows:
        notes = []
        if r["stale"]:
            notes.append(f"{len(r['stale'])} stored tensor(s) no longer produced, e.g. "
                         f"{r['stale'][0]}")
        if r["new"]:
            notes.append(f"{len(r['new'])} tensor(s) produced but not stored")
        if r.get("torch_changed_numbers"):
            notes.append(f"torch {r['torch_recorded']} -> {r['torch_now']} changes the numbers")
        if not r["serves"]:
            notes.append("serves no suite case")
        w = r["worst"] or max(r.get("quantities", {}).values(), default=None,
                              key=lambda q: q["excess"])
        diff = ("bitwise equal" if r["bitwise"] else
                f"{w['what']} {w['max_abs']:.1e} (tolerance {w['tolerance']:.1e})"
                if w and w["tolerance"] else "not compared")
        print(f"{r['name']}  {r['steps']} steps  sha256 "
              f"{'ok' if r['sha256_ok'] else 'MISMATCH'}  rerun: {diff}  "
              f"serves {len(r['serves'])} case(s)  {'ok' if r['ok'] else 'FAIL'}"
              + (f"  ({'; '.join(notes)})" if notes else ""))
