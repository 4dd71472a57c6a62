"""``parbench VERB key=value ... [--json]`` — the command line.

Verbs: run, list, report, schedule, estimate, traffic, mesh, golden. Bad input exits with
status 2 and one line ``parbench: error: ...`` naming field, value and rule, before any rank
is spawned; a failing rank exits with status 1 and that rank's traceback.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from .config import ConfigError, parse_overrides

USAGE = """usage: parbench VERB [key=value ...] [--json]

verbs:
  run suite=NAME [key=value ...]   run a suite on local ranks (or as a torchrun rank)
                                   options: out=DIR resume=true world_size=N
  list                             suites, schemes, schedules and model presets
  report DIR                       re-render tables and figures from a results directory
  schedule NAME p=4 m=8 [v=2] [tf=1 tb=1 tw=1 p2p=0]
                                   a pipeline schedule as a per-rank grid, simulated
  estimate [model=PRESET] [key=value ...] | params=7.5e9 dp=64
                                   the analytic model for any configuration and scale
  traffic [preset=ubmesh-moe-2t]   the per-parallelism traffic table
  mesh tp=2 pp=2 dp=2 [cp= ep=]    the rank grid and every process group (Megatron-Core layout)
  golden record|check [dir=golden] write or verify the golden files
"""


class UsageError(ConfigError):
    pass


def _emit(obj, as_json: bool, render) -> None:
    if as_json:
        print(json.dumps(obj, indent=2, sort_keys=True, default=str))
    else:
        render(obj)


# ---- run ------------------------------------------------------------------------------------


def cmd_run(args: list[str], as_json: bool) -> int:
    from .launch import RankError, in_torchrun
    from .suites import check_suite, load_suite, results_dir

    ov = parse_overrides(args)
    suite_name = ov.pop("suite", None)
    if not suite_name:
        raise UsageError("run needs suite=NAME (see `parbench list`)")
    out = ov.pop("out", None)
    resume = str(ov.pop("resume", "false")).lower() in ("1", "true", "yes")
    world = ov.pop("world_size", None)
    if world is not None:
        try:
            world = int(world)
        except ValueError:
            raise ConfigError(f"world_size={world!r} is not an integer") from None
    suite = load_suite(suite_name, ov)
    if in_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        suite.cases = [c for c in suite.cases if c.parallel.world_size == world] or suite.cases
    check_suite(suite, world)
    if in_torchrun():
        return _run_torchrun(suite, out, as_json)

    from rich.console import Console

    from .report import print_tables, write_report
    from .suites import run_suite

    import shutil
    console = Console(stderr=as_json,
                      width=max(shutil.get_terminal_size((160, 40)).columns, 200))
    out_dir = results_dir(suite.name, out, resume)
    console.print(f"[bold]parbench[/] suite [cyan]{suite.name}[/]: {len(suite.cases)} case(s), "
                  f"results in {out_dir}")
    t_start = time.time()

    def progress(event, i, n, case, row):
        if event == "start":
            console.print(f"  [{i + 1}/{n}] {case.run.scheme} "
                          f"(world {case.parallel.world_size}) ...", end="")
        else:
            status = "[green]pass[/]" if row["equivalent"] else "[red]FAIL[/]"
            st = row.get("step_time_s")
            console.print(f" {status}  {st * 1e3:.2f} ms/step" if st else f" {status}")

    try:
        rows = run_suite(suite, out_dir, resume=resume, progress=progress)
    except RankError as e:
        console.print()
        sys.stderr.write(f"parbench: rank {e.rank} failed; its traceback:\n{e.traceback_text}\n")
        sys.stderr.write(f"parbench: the run stopped; results of finished cases are kept in "
                         f"{out_dir / 'results.jsonl'}\n")
        return 1
    if as_json:
        print(json.dumps(rows, indent=2, default=str))
    else:
        print_tables(rows, console)
    paths = write_report(rows, out_dir)
    console.print(f"wrote {out_dir / 'results.jsonl'}, " + ", ".join(str(p) for p in paths)
                  + f" in {time.time() - t_start:.1f} s")
    failed = [r for r in rows if not r["equivalent"]]
    if failed:
        console.print(f"[red]{len(failed)} case(s) not equivalent to the golden run[/]")
        return 3
    return 0


def _run_torchrun(suite, out, as_json) -> int:
    import torch.distributed as dist

    from .harness import run_case
    from .launch import init_from_env
    from .results import append_row
    from .suites import make_row, results_dir

    device = suite.cases[0].run.device if suite.cases else "cpu"
    wctx = init_from_env(device)
    out_dir = results_dir(suite.name, out, False)
    if wctx.rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
    failed = 0
    for case in suite.cases:
        res = run_case(wctx, case.to_dict())
        gathered = [None] * wctx.world_size if wctx.rank == 0 else None
        dist.gather_object(res, gathered, dst=0)
        if wctx.rank == 0:
            row = make_row(suite.name, case, gathered, out_dir)
            append_row(out_dir / "results.jsonl", row)
            failed += not row["equivalent"]
            print(f"{case.id}: {'pass' if row['equivalent'] else 'FAIL'} "
                  f"{(row['step_time_s'] or 0) * 1e3:.2f} ms/step", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 3 if failed else 0


# ---- list / report ---------------------------------------------------------------------------


def cmd_list(args, as_json) -> int:
    from .config import PRESETS
    from .scheme import all_schemes
    from .suites import available_suites

    try:
        from .schedules import SCHEDULES
        scheds = sorted(SCHEDULES)
    except ImportError:
        scheds = []
    data = {"suites": {n: str(p) for n, p in available_suites().items()},
            "schemes": {n: {"family": c.family, "baseline_of": c.baseline_of,
                            "description": c.description} for n, c in all_schemes().items()},
            "schedules": scheds, "presets": PRESETS}

    def render(d):
        print("suites:    " + ", ".join(d["suites"]))
        print("schemes:")
        for n, c in d["schemes"].items():
            tag = f"  (baseline of {c['baseline_of']})" if c["baseline_of"] else ""
            print(f"  {n:34s} {c['family']:9s} {c['description']}{tag}")
        print("schedules: " + ", ".join(d["schedules"]))
        print("presets:   " + ", ".join(d["presets"]))

    _emit(data, as_json, render)
    return 0


def cmd_report(args, as_json) -> int:
    from .report import print_tables, write_report
    from .results import load_rows

    if not args:
        raise UsageError("report needs a results directory: parbench report DIR")
    d = Path(args[0])
    if not (d / "results.jsonl").exists():
        raise ConfigError(f"DIR={d} has no results.jsonl")
    rows = load_rows(d)
    if as_json:
        print(json.dumps(rows, indent=2, default=str))
    else:
        print_tables(rows)
    write_report(rows, d)
    return 0


# ---- mesh / golden ----------------------------------------------------------------------------


def cmd_mesh(args, as_json) -> int:
    from .mesh import MeshLayout

    ov = parse_overrides(args)
    deg = {}
    for k, v in ov.items():
        if k not in ("tp", "cp", "dp", "pp", "ep"):
            raise ConfigError(f"unknown key {k!r} for mesh (use tp, cp, ep, dp, pp)")
        try:
            deg[k] = int(v)
        except ValueError:
            raise ConfigError(f"{k}={v!r} is not an integer") from None
    try:
        layout = MeshLayout(**deg)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    data = layout.describe()

    def render(d):
        deg = d["degrees"]
        print(f"world {d['world_size']} = tp {deg['tp']} x cp {deg['cp']} x dp {deg['dp']} x "
              f"pp {deg['pp']}  (ep {deg['ep']} re-partitions tp x cp x dp; Megatron-Core order "
              "tp-cp-ep-dp-pp)")
        print("rank  " + "  ".join(f"{a:>3s}" for a in ("tp", "cp", "dp", "pp")))
        for r, c in d["ranks"].items():
            print(f"{r:4d}  " + "  ".join(f"{c[a]:3d}" for a in ("tp", "cp", "dp", "pp")))
        for name, groups in d["groups"].items():
            print(f"{name:9s} " + " ".join(str(g) for g in groups))

    _emit(data, as_json, render)
    return 0


def cmd_golden(args, as_json) -> int:
    from . import golden
    from .config import CaseConfig, apply_overrides

    if not args or args[0] not in ("record", "check"):
        raise UsageError("golden needs record or check: parbench golden record|check [dir=golden]")
    ov = parse_overrides(args[1:])
    directory = ov.pop("dir", "golden")
    if args[0] == "record":
        presets = [p.strip() for p in ov.pop("models", "tiny,tiny-4l").split(",")]
        out = []
        for name in presets:
            case = apply_overrides(CaseConfig(), {"model": name, **ov})
            out.append(golden.record(case, case.run.steps, directory, name))
        _emit(out, as_json, lambda d: print(f"recorded {len(d)} golden file(s) in {directory}"))
        return 0
    if not Path(directory, "manifest.json").exists():
        raise ConfigError(f"dir={directory} has no manifest.json (run `parbench golden record`)")
    rows = golden.check(directory)

    def render(rs):
        for r in rs:
            print(f"{r['name']:12s} sha256 {'ok' if r['sha256_ok'] else 'MISMATCH'}  "
                  f"rerun max|d| {r['max_abs']:.1e}  {'ok' if r['ok'] else 'FAIL'}")

    _emit(rows, as_json, render)
    return 0 if all(r["ok"] for r in rows) else 1


# ---- analytic verbs (schedules, estimate, traffic) ------------------------------------------


def cmd_schedule(args, as_json) -> int:
    from .cli_analytic import schedule_command
    return schedule_command(args, as_json)


def cmd_estimate(args, as_json) -> int:
    from .cli_analytic import estimate_command
    return estimate_command(args, as_json)


def cmd_traffic(args, as_json) -> int:
    from .cli_analytic import traffic_command
    return traffic_command(args, as_json)


VERBS = {"run": cmd_run, "list": cmd_list, "report": cmd_report, "mesh": cmd_mesh,
         "golden": cmd_golden, "schedule": cmd_schedule, "estimate": cmd_estimate,
         "traffic": cmd_traffic}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    as_json = "--json" in argv
    argv = [a for a in argv if a != "--json"]
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    verb, rest = argv[0], argv[1:]
    if verb not in VERBS:
        sys.stderr.write(f"parbench: error: unknown verb {verb!r} (choose from "
                         f"{', '.join(VERBS)})\n")
        return 2
    try:
        return VERBS[verb](rest, as_json)
    except ConfigError as e:
        sys.stderr.write(f"parbench: error: {e}\n")
        return 2
    except BrokenPipeError:  # output piped into `head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        sys.stderr.write("parbench: interrupted; finished results are kept\n")
        return 130


if __name__ == "__main__":
    sys.exit(main())
