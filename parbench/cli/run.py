"""``parbench run``: run a suite on local ranks (or join a torchrun / Slurm job as one rank)."""
from __future__ import annotations

import json
import os
import sys
import time

from ..config import ConfigError
from ..overrides import coerce, parse_overrides
from .output import UsageError, console


def _run_options(ov: dict) -> dict:
    """Pop the options of ``run`` itself (not case fields) from the overrides."""
    opts = {"suite": ov.pop("suite", None), "out": ov.pop("out", None),
            "resume": coerce(ov.pop("resume", "false"), bool, "resume"),
            "world_size": ov.pop("world_size", None),
            "deepspeed_config": ov.pop("deepspeed_config", None)}
    if not opts["suite"] and "scheme" not in ov:
        raise UsageError("run needs suite=NAME or scheme=NAME (see `parbench list`)")
    if opts["world_size"] is not None:
        opts["world_size"] = coerce(opts["world_size"], int, "world_size")
        if opts["world_size"] < 1:
            raise ConfigError(f"world_size={opts['world_size']} must be >= 1")
    return opts


def one_case_suite(ov: dict):
    """``parbench run scheme=NAME key=value ...``: one case from the command line, as a
    suite named after the scheme."""
    from ..suites import expand
    return expand({}, ov, default_name=ov["scheme"].replace(".", "-"))


def check_options_used(suite, overrides: dict) -> None:
    """An option field given on the command line must be read by some case's scheme."""
    from ..config import OPTIONAL_FIELDS
    from ..options import option_names
    from ..overrides import resolve_key
    from ..registry import get_scheme

    optional = set(option_names()) | set(OPTIONAL_FIELDS)
    for key, value in overrides.items():
        if key == "model":
            continue
        name = resolve_key(key).name
        if name not in optional:
            continue
        schemes = {c.run.scheme for c in suite.cases}
        if not any(name in get_scheme(s).options for s in schemes):
            raise ConfigError(f"{key}={value} is not used by any case of suite {suite.name} "
                              f"(its schemes do not read {name})")


def skip_unavailable(suite) -> None:
    """Drop the cases of schemes that cannot run here (an optional dependency missing),
    saying which and why on stderr."""
    from ..registry import get_scheme
    keep, why = [], {}
    for case in suite.cases:
        reason = get_scheme(case.run.scheme).unavailable()
        if reason:
            why[case.run.scheme] = reason
        else:
            keep.append(case)
    suite.cases = keep
    for name, reason in why.items():
        sys.stderr.write(f"parbench: skipping the cases of {name}: {reason}\n")


def load_checked_suite(args: list[str]):
    """The suite named by ``args`` with its overrides applied and every case checked."""
    from ..import_deepspeed import deepspeed_overrides
    from ..worker import in_torchrun
    from ..suites import check_suite, load_suite

    ov = parse_overrides(args)
    opts = _run_options(ov)
    if opts["deepspeed_config"]:
        ov = {**deepspeed_overrides(opts["deepspeed_config"], opts["world_size"]), **ov}
    suite = load_suite(opts["suite"], ov) if opts["suite"] else one_case_suite(ov)
    skip_unavailable(suite)
    check_options_used(suite, ov)
    world = opts["world_size"]
    if in_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        keep_world_size(suite, world)
    check_suite(suite, world)
    require_devices(suite)
    return suite, opts


def require_devices(suite) -> None:
    """Every case's device can run here, before a rank is spawned: ``device=cuda`` on a
    machine without CUDA, or more NCCL ranks than GPUs, is bad input (``parbench.device``)."""
    from ..device import DeviceError, require
    for device, world in sorted({(c.run.device, c.layout.world_size) for c in suite.cases}):
        try:
            require(device, world)
        except DeviceError as e:
            raise ConfigError(str(e)) from None


def keep_world_size(suite, world: int) -> None:
    """Under torchrun: keep the cases of this job's world size (rank 0 says which others it
    leaves out); none is bad input naming the world size and the cases' (issue 20, sec. 8:
    every case ran instead)."""
    sizes = sorted({c.layout.world_size for c in suite.cases})
    kept = [c for c in suite.cases if c.layout.world_size == world]
    if not kept:
        raise ConfigError(f"WORLD_SIZE={world} (this torchrun job) matches no case of suite "
                          f"{suite.name}: its cases need world sizes "
                          f"{', '.join(map(str, sizes))}")
    left = len(suite.cases) - len(kept)
    if left and os.environ.get("RANK", "0") == "0":
        others = ", ".join(str(w) for w in sizes if w != world)
        sys.stderr.write(f"parbench: running the {len(kept)} case(s) of world size {world}; "
                         f"leaving out {left} of world size {others}\n")
    suite.cases = kept


def cmd_run(args: list[str], as_json: bool = False, wide: bool = False) -> int:
    from rich.markup import escape

    from ..worker import in_torchrun
    from ..report import print_tables, write_report
    from ..report.cells import verdict
    from ..runner import results_dir, run_cases
    from .reproduce import run_papers_suite

    if (code := run_papers_suite(args, as_json)) is not None:  # suite=papers: no ranks
        return code
    suite, opts = load_checked_suite(args)
    if in_torchrun():
        return _run_torchrun(suite, opts["out"])
    out = console(stderr=as_json)
    out_dir = results_dir(suite.name, opts["out"], opts["resume"])
    out.print(f"[bold]parbench[/] suite [cyan]{suite.name}[/]: {len(suite.cases)} case(s), "
              f"results in {out_dir}")
    t_start = time.time()

    def progress(event, i, n, case, row):
        if event == "start":
            out.print(f"  [{i + 1}/{n}] {case.run.scheme} "
                      f"(world {case.layout.world_size}) ...", end="")
        else:
            st = row.time.step_s
            out.print(f" {verdict(row)}  {st * 1e3:.2f} ms/step" if st else f" {verdict(row)}")
            if row.verdict.failure:
                _report_failure(row)
            elif row.verdict.first_failure:
                out.print(f"    first failure: {escape(str(row.verdict.first_failure))}",
                          soft_wrap=True, highlight=False)

    rows = run_cases(suite.name, suite.cases, out_dir, resume=opts["resume"],
                     progress=progress)
    if as_json:
        print(json.dumps([r.to_dict() for r in rows], indent=2, default=str))
    else:
        print_tables(rows, out, wide=wide)
    paths = write_report(rows, out_dir)
    out.print(f"wrote {out_dir / 'results.jsonl'}, " + ", ".join(str(p) for p in paths)
              + f" in {time.time() - t_start:.1f} s")
    broken = [r for r in rows if r.verdict.status != "ok"]
    failed = [r for r in rows if r.verdict.status == "ok" and not r.passed
              and not r.verdict.known_finding]
    for finding in sorted({r.verdict.known_finding for r in rows if r.verdict.known_finding}):
        out.print(f"[yellow]known framework finding reproduced[/]: {escape(finding)}")
    if failed:
        out.print(f"[red]{len(failed)} case(s) not equivalent to the golden run[/]")
    if broken:
        out.print(f"[red]{len(broken)} case(s) crashed or hung[/] (tracebacks above; rows "
                  f"with status 'failed' in {out_dir / 'results.jsonl'})")
        return 1
    return 3 if failed else 0


def _report_failure(row) -> None:
    f = row.verdict.failure
    who = f"rank {f.rank}" if f.rank >= 0 else "the case"
    sys.stderr.write(f"parbench: {row.scheme}: {who} {f.kind}; its traceback:\n"
                     f"{f.traceback}\n")


def _run_torchrun(suite, out) -> int:
    """This process is one rank of a torchrun / Slurm job; rank 0 writes the rows."""
    import torch.distributed as dist

    from ..worker import init_from_env
    from ..report import write_report
    from ..results import append_row
    from ..runner import results_dir, torchrun_case_row

    device = suite.cases[0].run.device if suite.cases else "cpu"
    wctx = init_from_env(device)
    out_dir = results_dir(suite.name, out, False)
    if wctx.rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for case in suite.cases:
        row = torchrun_case_row(wctx, case, suite.name, out_dir)
        if row is not None:
            append_row(out_dir / "results.jsonl", row)
            rows.append(row)
            print(f"{case.id}: {'pass' if row.passed else 'FAIL'} "
                  f"{(row.time.step_s or 0) * 1e3:.2f} ms/step", flush=True)
    if wctx.rank == 0:  # the report, as a local run writes it
        paths = write_report(rows, out_dir)
        print(f"wrote {out_dir / 'results.jsonl'}, " + ", ".join(str(p) for p in paths),
              flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 3 if any(not r.passed for r in rows) else 0


def cmd_selftest(args: list[str], as_json: bool = False, wide: bool = False) -> int:
    """The mutation catalogue: exit 0 when every mutant is killed by a check and no control
    fails; 3 when a mutant survives or a control fails; 1 when a mutant was only killed by a
    crash or refused before running (``parbench.mutation.exit_status``)."""
    from ..mutation import exit_status, outcome, run_selftest, summary_line, why_failed

    from rich.markup import escape

    ov = parse_overrides(args)
    profile = ov.pop("profile", "full")
    if profile not in ("ci", "full"):
        raise ConfigError(f"profile={profile!r} must be ci or full")
    seeds = coerce(ov.pop("seeds", "5"), int, "seeds")
    if seeds < 1:
        raise ConfigError(f"seeds={seeds} must be >= 1")
    only = [m for m in ov.pop("only", "").split(",") if m] or None
    if ov:
        raise ConfigError(f"unknown key {next(iter(ov))!r} for selftest (profile=, seeds=, "
                          "only=)")
    out = console(stderr=as_json)
    tags = {"check": "[green]killed[/]", "crash": "[yellow]crashed (not a check)[/]",
            "refused": "[yellow]refused before running (not a check)[/]",
            "survived": "[red]SURVIVED[/]"}

    def progress(kind, mutant, row):
        if kind == "skipped":  # row: why its scheme is unavailable
            out.print(f"  {mutant.id:32s} [yellow]skipped[/]: {escape(row)}")
        elif kind == "mutant":
            out.print(f"  {mutant.id:32s} {tags[outcome(row)]}  ({escape(mutant.bug)})")
        elif not row.passed:
            out.print(f"  [red]false alarm[/]: unmodified {row.scheme} seed "
                      f"{row.case.config['run']['seed']}: {escape(why_failed(row))}")

    out.print("[bold]parbench selftest[/]: every injected bug must be caught by a check")
    result = run_selftest(profile, seeds, only, progress)
    if as_json:
        print(json.dumps(result, indent=2, default=str))
    out.print(summary_line(result))  # on stderr with --json
    if only is not None and not result["mutants"]:
        raise ConfigError(f"only={','.join(only)} names no mutant of profile {profile}")
    return exit_status(result)
