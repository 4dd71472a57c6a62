"""Running one case on one rank: build mesh and scheme, step, check, measure.

Every rank calls ``run_case`` with the same case. Per checked step: the step runs with the
ledger and timeline attached; then, outside the ledger, the model states live on the rank
are attributed by the memory tracker, and the scheme's unsharded gradients and parameters are
compared with the golden run and its update with a shadow optimizer on this rank (each rank
checks what it holds; ``parbench.verdict`` merges the ranks). The memory peak is taken on
step 1 (optimizer states exist by then). The ``timed_steps`` after the checked ones are timed
between barriers, the first ``warmup_steps`` of them discarded: checked steps carry the
checking and the baselines' capture work and are never timed.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from .comm import Ledger
from .config import CaseConfig
from .golden import global_batch
from .memory import PeakMemory, model_states
from .mesh import Mesh
from .model import compute_dtype
from .results import RankResult
from .scheme import SchemeContext, get_scheme
from .timeline import Timeline
from .checks import RankChecker

_MESHES: dict[tuple, Mesh] = {}


def get_mesh(case: CaseConfig, rank: int) -> Mesh:
    """Meshes are cached per process: every rank runs the same cases in the same order."""
    key = case.layout.grid()
    if key not in _MESHES:
        _MESHES[key] = Mesh.build(key, rank)
    return _MESHES[key]


def run_case(wctx, case_dict: dict) -> RankResult:
    """One case on this rank (``wctx``: the pool's or torchrun's WorkerContext)."""
    case = CaseConfig.from_dict(case_dict)
    rank, run = wctx.rank, case.run
    progress = wctx.progress
    progress(f"building {run.scheme}")
    torch.manual_seed(run.seed)
    cls = get_scheme(run.scheme)
    mesh = get_mesh(case, rank)
    timeline = Timeline(rank, enabled=run.instrument)
    ctx = SchemeContext(case=case, mesh=mesh, device=torch.device(wctx.device),
                        timeline=timeline)
    scheme = cls(ctx)
    golden = cls.reference(case, run.steps)
    checker = RankChecker(scheme, case, golden)
    dtype = compute_dtype(run)
    progress("built")

    memory_step = 1 if run.steps > 1 else 0
    step_times, losses, checks = [], [], []
    wire_per_step: list[dict[str, float]] = []
    calls_per_step: list[dict[str, int]] = []
    states: list[dict[str, int]] = []
    ledger_records: list[dict] = []
    trace_events: list[dict] = []
    peak = None
    for step in range(run.steps + run.timed_steps):
        if run.fail_at_step == step and rank == run.fail_rank:
            _inject_failure(run.fail_kind, step, rank)
        progress(f"step {step}")
        x, y = global_batch(case, step)
        ledger = Ledger(axis_of=mesh.axis_of_group, timeline=timeline) if run.instrument \
            else Ledger(axis_of=mesh.axis_of_group, timeline=None, recording=False)
        timeline.clear()
        dist.barrier()
        if step == memory_step:
            base = sum(model_states(scheme, dtype).values())
            with PeakMemory(wctx.device.split(":")[0], base) as pm, ledger:
                loss = scheme.train_step(x, y, step)
            peak = pm.peak
        else:
            t0 = time.perf_counter()
            with ledger:
                loss = scheme.train_step(x, y, step)
            if wctx.device.startswith("cuda"):
                torch.cuda.synchronize()
            if step >= run.steps + run.warmup_steps:
                step_times.append(time.perf_counter() - t0)
        dist.barrier()
        wire_per_step.append(ledger.wire_by_axis())
        calls_per_step.append(ledger.calls_by_axis())
        if step == run.steps - 1:
            ledger_records = ledger.as_dicts()
            trace_events = timeline.as_dicts()
        if step < run.steps:
            progress(f"checking step {step}")
            states.append(model_states(scheme, dtype))
            losses.append(loss)
            checks.append(checker.check(step, loss, x, y))
    return RankResult(rank=rank, losses=losses, checks=checks, step_times=step_times,
                      peak_bytes=peak, model_states_per_step=states,
                      wire_by_axis_per_step=wire_per_step,
                      calls_by_axis_per_step=calls_per_step, ledger=ledger_records,
                      timeline=trace_events, metrics=scheme.metrics())


def _inject_failure(kind: str, step: int, rank: int) -> None:
    """Testing aid (``fail_at_step``, ``fail_rank``, ``fail_kind``): raise, or sleep forever
    as a hung rank does (the other ranks then wait in the step's first collective)."""
    if kind == "hang":
        while True:
            time.sleep(3600)
    raise RuntimeError(f"injected failure at step {step} on rank {rank} "
                       "(fail_at_step is a testing aid)")
