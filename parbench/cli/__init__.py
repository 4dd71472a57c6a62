"""``parbench VERB key=value ... [--json]`` -- the command line.

Verbs that spawn ranks live in ``cli/run.py``; verbs that read results or describe things in
``cli/inspect.py``; the analytic model's verbs in ``cli/analytic.py``. Bad input exits with
status 2 and one line ``parbench: error: ...`` naming field, value and rule, before any rank
is spawned; a failing rank exits with status 1 and that rank's traceback. SIGTERM and SIGHUP
end a command as an exception does (its pools of ranks closed, finished rows kept) with status
128 + the signal's number (``parbench.terminate``).

Each verb imports what it runs inside its function, on purpose: ``parbench --help``, a verb's
``--help`` and bad input answer without importing torch or the schemes.
"""
from __future__ import annotations

import os
import sys

from ..config import ConfigError
from ..terminate import run_terminable
from . import analytic, calibrate, compare, inspect, plan, reproduce, run, schedule, verify
from .help import VERBS_HELP, usage, verb_help

VERBS = {"run": run.cmd_run, "verify": verify.cmd_verify, "compare": compare.cmd_compare,
         "list": inspect.cmd_list, "report": inspect.cmd_report,
         "mesh": inspect.cmd_mesh, "golden": inspect.cmd_golden,
         "schedule": schedule.cmd_schedule, "estimate": analytic.cmd_estimate,
         "traffic": analytic.cmd_traffic, "calibrate": calibrate.cmd_calibrate,
         "plan": plan.cmd_plan, "reproduce": reproduce.cmd_reproduce, "selftest": run.cmd_selftest}
FLAGS = ("--json", "--wide", "--verbose")
HELP = ("-h", "--help")
assert set(VERBS) == set(VERBS_HELP), "every verb has its --help"
#: verbs whose summary has a full breakdown behind ``--verbose`` (their key ``verbose=true``)
VERBOSE_VERBS = ("estimate", "plan")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    return run_terminable(_main_piped, argv, prog="parbench")


def _main_piped(argv: list[str]) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:  # output piped into `head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _main(argv: list[str]) -> int:
    flags = {f: f in argv for f in FLAGS}
    argv = [a for a in argv if a not in FLAGS]
    if argv[:1] == ["help"] and argv[1:2]:
        argv = [argv[1], "--help"]
    if not argv or argv[0] in HELP + ("help",):
        print(usage())
        return 0
    verb, rest = argv[0], argv[1:]
    if verb in VERBS and any(a in HELP for a in rest):
        print(verb_help(verb))
        return 0
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
    except KeyboardInterrupt:
        sys.stderr.write("parbench: interrupted; finished results are kept\n")
        return 130
