"""``parbench VERB key=value ... [--json]`` -- the command line.

Verbs that spawn ranks live in ``cli/run.py``; verbs that read results or describe things in
``cli/inspect.py``; the analytic model's verbs in ``cli/analytic.py``. Bad input exits with
status 2 and one line ``parbench: error: ...`` naming field, value and rule, before any rank
is spawned; a failing rank exits with status 1 and that rank's traceback.
"""
from __future__ import annotations

import os
import sys

from ..config import ConfigError
from . import analytic, calibrate, compare, inspect, plan, reproduce, run, schedule, verify

USAGE = """usage: parbench VERB [key=value ...] [--json]

verbs:
  run suite=NAME [key=value ...]   run a suite on local ranks (or as a torchrun rank)
                                   options: out=DIR resume=true world_size=N
                                   deepspeed_config=FILE.json
  verify scheme=pkg.module:Class [suite=NAME] [key=value ...] [strict_bytes=true]
                                   your own scheme against the golden run, its family's
                                   native scheme and the closed-form bytes (exit 0/3/2)
  compare OLD NEW [bytes_tol=0] [time_tol=auto|0.2] [ignore_time=true] [match=id|config]
          [gate_baselines=true]    two results directories (or results.jsonl) matched by
                                   case; exit 1 on a regression (the CI gate)
  list                             suites, schemes, schedules and model presets
  report DIR [--wide]              re-render tables and figures from a results directory
  schedule NAME p=4 m=8 [v=2] [tf=1 tb=1 tw=1 p2p=0]
                                   a pipeline schedule as a per-rank grid, simulated
  estimate [model=PRESET] [key=value ...] | params=7.5e9 dp=64
                                   the analytic model for any configuration and scale
                                   (megatron_args="--num-layers 96 ..." imports Megatron's)
  traffic [preset=ubmesh-moe-2t]   the per-parallelism traffic table
  calibrate [device=cpu|cuda] [out=FILE.json]
                                   measure this machine: matmul, memory bandwidth, each
                                   collective's latency and bandwidth per group size
  plan model=PRESET world=N device=PROFILE [global_batch_size=] [seq_length=]
                                   rank every parallel layout by predicted step time
  reproduce NAME|all               a paper's table beside the tool's figures
  mesh tp=2 pp=2 dp=2 [cp= ep=]    the rank grid and every process group (Megatron-Core layout)
  golden record|check [dir=golden] write or verify the golden files
  selftest [profile=ci|full] [seeds=5] [only=ID,...]
                                   inject the catalogue of bugs: every one must be caught

flags: --json (machine-readable output), --wide (every column of the result tables),
       --verbose (estimate and plan: the full breakdown behind the summary)
"""

VERBS = {"run": run.cmd_run, "verify": verify.cmd_verify, "compare": compare.cmd_compare,
         "list": inspect.cmd_list, "report": inspect.cmd_report,
         "mesh": inspect.cmd_mesh, "golden": inspect.cmd_golden,
         "schedule": schedule.cmd_schedule, "estimate": analytic.cmd_estimate,
         "traffic": analytic.cmd_traffic, "calibrate": calibrate.cmd_calibrate,
         "plan": plan.cmd_plan, "reproduce": reproduce.cmd_reproduce, "selftest": run.cmd_selftest}
FLAGS = ("--json", "--wide", "--verbose")
#: verbs whose summary has a full breakdown behind ``--verbose`` (their key ``verbose=true``)
VERBOSE_VERBS = ("estimate", "plan")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    flags = {f: f in argv for f in FLAGS}
    argv = [a for a in argv if a not in FLAGS]
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    verb, rest = argv[0], argv[1:]
    if verb not in VERBS:
        sys.stderr.write(f"parbench: error: unknown verb {verb!r} (choose from "
                         f"{', '.join(VERBS)})\n")
        return 2
    if flags["--verbose"]:
        if verb not in VERBOSE_VERBS:
            sys.stderr.write(f"parbench: error: --verbose is a flag of "
                             f"{' and '.join(VERBOSE_VERBS)}, not of {verb}\n")
            return 2
        rest = [a for a in rest if not a.startswith("verbose=")] + ["verbose=true"]
    try:
        return VERBS[verb](rest, as_json=flags["--json"], wide=flags["--wide"])
    except ConfigError as e:
        sys.stderr.write(f"parbench: error: {e}\n")
        return 2
    except BrokenPipeError:  # output piped into `head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        sys.stderr.write("parbench: interrupted; finished results are kept\n")
        return 130
