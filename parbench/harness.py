"""Running one case on one rank: build mesh and scheme, step, check, measure.

Every rank calls ``run_case`` with the same case. Per checked step: the step runs with the
ledger and timeline attached; then, outside the ledger, the model states live on the rank
are attributed by the memory tracker, and the scheme's unsharded gradients and parameters are
compared with the golden run and its update with a shadow optimizer on this rank (each rank
checks what it holds; ``parbench.verdict`` merges the ranks). The memory peak is taken on
step 1 (optimizer states exist by then). The ``timed_steps`` after the checked ones are timed
between barriers, the first ``warmup_steps`` of them discarded: checked steps carry the
checking and the baselines' capture work and are never timed. The timed steps are verified
too (issue 20): their ledgers are recorded like the checked steps' (``parbench.verdict.timed``
holds them to the closed form or the checked steps), and after the last one the final
parameters are checked against the golden rule over every step (``verdict.final``; its
golden work runs after the timed steps, never inside one).
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import thread_cpu
from .comm import Ledger
from .config import CaseConfig
from .device import StepTimer, kind
from .golden import global_batch
from .memory import PeakMemory, model_states
from .mesh import Mesh
from .model import compute_dtype
from .results import BubbleFigures, RankResult, SchemeFigures
from .scheme import SchemeContext
from .registry import get_scheme
from .timeline import Timeline
from .verdict.checks import RankChecker
from .verdict.final import final_check
from .verdict.once import on_rank0

_MESHES: dict[tuple, Mesh] = {}


def get_mesh(case: CaseConfig, rank: int) -> Mesh:
    """Meshes are cached per process: every rank runs the same cases in the same order."""
    key = case.layout.grid()
    if key not in _MESHES:
        _MESHES[key] = Mesh.build(key, rank)
    return _MESHES[key]


@dataclass
class _Steps:
    """What the steps of one case leave on this rank."""

    step_times: list[float] = field(default_factory=list)
    step_cpu_times: list[float] = field(default_factory=list)
    step_own_cpu_times: list[float] = field(default_factory=list)
    #: CPU seconds of the process's other threads by name, summed over the timed steps
    threads_cpu: Counter = field(default_factory=Counter)
    losses: list = field(default_factory=list)
    checks: list = field(default_factory=list)
    wire: list[dict[str, float]] = field(default_factory=list)
    calls: list[dict[str, int]] = field(default_factory=list)
    states: list[dict[str, int]] = field(default_factory=list)
    ledger: list[dict] = field(default_factory=list)
    timeline: list[dict] = field(default_factory=list)
    peak: int | None = None
    #: wall seconds spent in the verdict's work on this rank (golden run, checks)
    verdict_s: float = 0.0


@dataclass
class _Rank:
    """One rank's part of a case: the scheme built, its checker and its instruments."""

    wctx: object
    case: CaseConfig
    scheme: object
    checker: RankChecker
    mesh: Mesh
    timeline: Timeline


def run_case(wctx, case_dict: dict) -> RankResult:
    """One case on this rank (``wctx``: the pool's or torchrun's WorkerContext)."""
    t_case = time.perf_counter()
    case = CaseConfig.from_dict(case_dict)
    run = case.run
    torch.manual_seed(run.seed)
    # building the scheme is local work for the hang detector (a framework's first import and
    # engine set-up take a minute on a loaded machine); a rank stuck in one of the ledger's
    # collectives is still a hang, one stuck in a framework's own set-up ends at timeout_s
    with wctx.working(f"building {run.scheme}"):
        cls = get_scheme(run.scheme)
        mesh = get_mesh(case, wctx.rank)
        timeline = Timeline(wctx.rank, enabled=run.instrument)
        scheme = cls(SchemeContext(case=case, mesh=mesh, device=torch.device(wctx.device),
                                   timeline=timeline))
    out = _Steps()
    t0 = time.perf_counter()
    with wctx.working("golden run"):  # local work: progress for the hang detector
        golden = on_rank0(lambda: cls.reference(case, run.steps), run.shared_reference)
        checker = RankChecker(scheme, case, golden)
    out.verdict_s += time.perf_counter() - t0
    me = _Rank(wctx, case, scheme, checker, mesh, timeline)
    wctx.progress("built")
    total = run.steps + run.timed_steps
    for step in range(total):
        _step(me, step, out)
    final = None
    if run.timed_steps:
        t0 = time.perf_counter()
        with wctx.working("checking the final state"):
            final = final_check(me.checker, case, total, global_batch)
        out.verdict_s += time.perf_counter() - t0
    figures, bubble = split_figures(scheme.metrics())
    return RankResult(rank=wctx.rank, losses=out.losses, checks=out.checks,
                      step_times=out.step_times, step_cpu_times=out.step_cpu_times,
                      step_own_cpu_times=out.step_own_cpu_times,
                      threads_cpu_s={k: v / len(out.step_times) for k, v in
                                     out.threads_cpu.items()} if out.step_times else {},
                      peak_bytes=out.peak,
                      model_states_per_step=out.states, wire_by_axis_per_step=out.wire,
                      calls_by_axis_per_step=out.calls, ledger=out.ledger,
                      timeline=out.timeline, metrics=figures, bubble=bubble, final=final,
                      case_s=time.perf_counter() - t_case, verdict_s=out.verdict_s)


def time_case(wctx, case_dict: dict) -> dict:
    """One case's steps on this rank with the instruments of ``run_case`` -- the scheme's
    ``train_step`` under the ledger, the memory peak on step 1, the timed steps after the
    warm-up on the device's clock -- and no golden run and no checks: for a model whose
    golden run the host cannot afford (the device check's ~1B-parameter step on one GPU;
    the golden run trains on the host's CPU). Returns the step times, the peak and the
    model states, not a verified row."""
    case = CaseConfig.from_dict(case_dict)
    run = case.run
    torch.manual_seed(run.seed)
    with wctx.working(f"building {run.scheme}"):
        mesh = get_mesh(case, wctx.rank)
        timeline = Timeline(wctx.rank, enabled=False)
        scheme = get_scheme(run.scheme)(SchemeContext(
            case=case, mesh=mesh, device=torch.device(wctx.device), timeline=timeline))
    me = _Rank(wctx, case, scheme, None, mesh, timeline)
    out = _Steps()
    for step in range(run.steps + run.timed_steps):
        wctx.progress(f"step {step}")
        x, y = global_batch(case, step)
        ledger = Ledger(axis_of=mesh.axis_of_group, timeline=None, recording=run.instrument)
        dist.barrier()
        loss = _train(me, step, x, y, ledger, out)
        out.losses.append(None if loss is None else float(loss))
        dist.barrier()
    return {"rank": wctx.rank, "device": wctx.device, "step_times": out.step_times,
            "peak_bytes": out.peak, "losses": out.losses,
            "model_states": model_states(scheme, compute_dtype(run))}


def split_figures(metrics: dict) -> tuple[SchemeFigures, BubbleFigures | None]:
    """A scheme's ``metrics()``: its own figures, and its bubble figures (a pipeline's)."""
    figures = dict(metrics)
    bubble = figures.pop("bubble", None)
    if bubble is not None and not isinstance(bubble, BubbleFigures):
        raise TypeError(f"metrics()['bubble'] is a {type(bubble).__name__}, not BubbleFigures")
    return figures, bubble


def _step(me: _Rank, step: int, out: _Steps) -> None:
    """One step (checked or timed) on this rank, with the ledger and timeline attached."""
    case, rank, run = me.case, me.wctx.rank, me.case.run
    if run.fail_at_step == step and rank == run.fail_rank:
        _inject_failure(run.fail_kind, step, rank)
    me.wctx.progress(f"step {step}")
    x, y = global_batch(case, step)
    # the collectives' completion times go to the timeline of the step it exports (the
    # last checked one) only: elsewhere a completion callback per asynchronous call would
    # cost the instruments' share of every timed step and nothing reads it
    exported = step == run.steps - 1
    on = instrumented(run, step)
    ledger = Ledger(axis_of=me.mesh.axis_of_group,
                    timeline=me.timeline if exported else None) if on \
        else Ledger(axis_of=me.mesh.axis_of_group, timeline=None, recording=False)
    me.timeline.clear()
    me.timeline.enabled = on
    dist.barrier()
    loss = _train(me, step, x, y, ledger, out)
    dist.barrier()
    me.timeline.enabled = run.instrument
    skipped = run.instrument and not on  # an instrument_ab step without the instruments
    out.wire.append(None if skipped else ledger.wire_by_axis())
    out.calls.append(None if skipped else ledger.calls_by_axis())
    if step == run.steps - 1:
        out.ledger = ledger.as_dicts()
        out.timeline = me.timeline.as_dicts()
    if step < run.steps:
        me.wctx.progress(f"checking step {step}")
        out.states.append(model_states(me.scheme, compute_dtype(run)))
        out.losses.append(loss)
        t0 = time.perf_counter()
        out.checks.append(me.checker.check(step, loss, x, y))
        out.verdict_s += time.perf_counter() - t0


def instrumented(run, step: int) -> bool:
    """Whether ``step`` runs with the ledger and timeline: every step with
    ``instrument``, but under ``instrument_ab`` every other timed step (the first with)."""
    if not run.instrument:
        return False
    return not (run.instrument_ab and step >= run.steps and (step - run.steps) % 2 == 1)


def _train(me: _Rank, step: int, x, y, ledger: Ledger, out: _Steps):
    """The scheme's step: its memory peak taken on step 1 (optimizer states exist by then),
    timed on the timed steps after the warm-up."""
    run, device = me.case.run, me.wctx.device
    if step == (1 if run.steps > 1 else 0):
        base = sum(model_states(me.scheme, compute_dtype(run)).values())
        with PeakMemory(kind(device), base) as pm, ledger:
            loss = me.scheme.train_step(x, y, step)
        out.peak = pm.peak
        return loss
    # on CUDA the step is timed by events on the device, synchronised at its end; on CPU by
    # the host's clock (parbench.device.StepTimer)
    timed = step >= run.steps + run.warmup_steps
    threads0 = thread_cpu.by_thread() if timed else None  # outside the timer
    timer, c0 = StepTimer(device).start(), time.process_time()
    own0 = thread_cpu.own_seconds()
    with ledger:
        loss = me.scheme.train_step(x, y, step)
    seconds = timer.stop()
    if timed:
        out.step_own_cpu_times.append(thread_cpu.own_seconds() - own0)
        out.step_times.append(seconds)
        out.step_cpu_times.append(time.process_time() - c0)
        thread_cpu.add_delta(out.threads_cpu, threads0, thread_cpu.by_thread())
    return loss


def _inject_failure(kind: str, step: int, rank: int) -> None:
    """Testing aid (``fail_at_step``, ``fail_rank``, ``fail_kind``): raise, or sleep forever
    as a hung rank does (the other ranks then wait in the step's first collective)."""
    if kind == "hang":
        while True:
            time.sleep(3600)
    raise RuntimeError(f"injected failure at step {step} on rank {rank} "
                       "(fail_at_step is a testing aid)")
