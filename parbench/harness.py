"""Running one case on one rank: build mesh and scheme, step, check, measure.

Every rank calls ``run_case`` with the same case. Per checked step: the step runs with the
ledger and timeline attached; then, outside the ledger, the scheme's unsharded gradients and
parameters are compared with the golden run on this rank (each rank checks what it holds;
the caller merges). The memory peak is taken on step 1 (optimizer states exist by then) and
that step is not timed. Step times are the wall time of each further step between barriers.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from .comm import Ledger
from .config import CaseConfig
from .golden import compare, global_batch
from .memory import PeakMemory, model_state_bytes, storage_bytes
from .mesh import Mesh, MeshLayout
from .scheme import SchemeContext, get_scheme
from .timeline import Timeline

_MESHES: dict[tuple, Mesh] = {}


def get_mesh(case: CaseConfig, rank: int) -> Mesh:
    """Meshes are cached per process: every rank runs the same cases in the same order."""
    p = case.parallel
    key = (p.tp, p.cp, p.dp, p.pp, p.ep)
    if key not in _MESHES:
        layout = MeshLayout(tp=p.tp, cp=p.cp, dp=p.dp, pp=p.pp, ep=p.ep)
        _MESHES[key] = Mesh.build(layout, rank)
    return _MESHES[key]


def _barrier(mesh: Mesh) -> None:
    dist.barrier()


def run_case(wctx, case_dict: dict) -> dict:
    case = CaseConfig.from_dict(case_dict)
    rank = wctx.rank
    run = case.run
    torch.manual_seed(run.seed)
    cls = get_scheme(run.scheme)
    mesh = get_mesh(case, rank)
    timeline = Timeline(rank)
    ctx = SchemeContext(case=case, mesh=mesh, device=torch.device(wctx.device), timeline=timeline)
    scheme = cls(ctx)
    golden = cls.reference(case, run.steps)
    axis_of = mesh.axis_of_group

    total_steps = run.steps + run.timed_steps
    memory_step = 1 if run.steps > 1 else 0
    step_times, losses, checks = [], [], []
    step_ledger: list[dict] = []
    ledger_records: list[dict] = []
    peak = None
    states = None
    trace_events: list[dict] = []
    for step in range(total_steps):
        if run.fail_at_step == step and rank == run.fail_rank:
            raise RuntimeError(f"injected failure at step {step} on rank {rank} "
                               "(fail_at_step is a testing aid)")
        x, y = global_batch(case, step)
        ledger = Ledger(axis_of=axis_of, timeline=timeline)
        timeline.clear()
        _barrier(mesh)
        if step == memory_step:
            base = storage_bytes(_flat(scheme.state_tensors()))
            with PeakMemory(wctx.device.split(":")[0], base) as pm, ledger:
                loss = scheme.train_step(x, y, step)
            peak = pm.peak
        else:
            t0 = time.perf_counter()
            with ledger:
                loss = scheme.train_step(x, y, step)
            if wctx.device.startswith("cuda"):
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            if step >= run.warmup_steps:
                step_times.append(dt)
        _barrier(mesh)
        step_ledger.append(ledger.wire_by_axis())
        if step == run.steps - 1:
            ledger_records = ledger.as_dicts()
            trace_events = timeline.as_dicts()
            states = model_state_bytes(scheme.state_tensors())
        if step < run.steps:
            losses.append(loss)
            checks.append(_check(scheme, golden, step, loss, run))
    metrics = scheme.extra_metrics()
    return {
        "rank": rank,
        "losses": losses,
        "checks": checks,
        "step_times": step_times,
        "peak_bytes": peak,
        "model_state_bytes": states,
        "wire_by_axis_per_step": step_ledger,
        "ledger": ledger_records,
        "timeline": trace_events,
        "extra": metrics,
    }


def _flat(states: dict) -> list:
    return [t for v in states.values() for t in v]


def _check(scheme, golden, step: int, loss, run) -> dict:
    grads = scheme.full_grads()
    params = scheme.full_params()
    # step 0 runs on identical weights: gradients must agree to fp32 reduction noise (atol).
    # Later steps run on weights that already carry AdamW's amplified drift (param_atol),
    # so their gradients are held to param_atol.
    g = compare(grads, golden.grads[step], run.rtol, run.atol if step == 0 else run.param_atol)
    p = compare(params, golden.params[step], run.rtol, run.param_atol)
    out = {"step": step, "grad_max_abs": g["max_abs"], "grad_ok": g["ok"],
           "param_max_abs": p["max_abs"], "param_ok": p["ok"],
           "names": sorted(set(g["names"]) | set(p["names"])),
           "missing": g["missing"] + p["missing"]}
    if loss is not None:
        d = abs(float(loss) - golden.losses[step])
        out.update({"loss": float(loss), "golden_loss": golden.losses[step], "loss_abs": d,
                    "loss_ok": d <= run.atol + run.rtol * abs(golden.losses[step])})
    return out


def merge_ranks(per_rank: list[dict], golden_names: list[str] | None = None) -> dict:
    """Combine the per-rank results of one case into one summary."""
    steps = len(per_rank[0]["checks"])
    loss_abs, grad_abs, param_abs, ok = 0.0, 0.0, 0.0, True
    covered: set[str] = set()
    losses = []
    for s in range(steps):
        step_loss = None
        for r in per_rank:
            c = r["checks"][s]
            grad_abs = max(grad_abs, c["grad_max_abs"])
            param_abs = max(param_abs, c["param_max_abs"])
            ok = ok and c["grad_ok"] and c["param_ok"] and not c["missing"]
            covered |= set(c["names"])
            if "loss_abs" in c:
                loss_abs = max(loss_abs, c["loss_abs"])
                ok = ok and c["loss_ok"]
                step_loss = c["loss"]
        if step_loss is None:
            ok = False  # no rank reported the loss
        losses.append(step_loss)
    uncovered = sorted(set(golden_names or []) - covered)
    if uncovered:
        ok = False
    times = [statistics.median(r["step_times"]) for r in per_rank if r["step_times"]]
    step_time = max(times) if times else None
    return {
        "equivalent": ok,
        "max_loss_abs": loss_abs,
        "max_grad_abs": grad_abs,
        "max_param_abs": param_abs,
        "uncovered": uncovered,
        "losses": losses,
        "step_time_s": step_time,
        "peak_bytes": [r["peak_bytes"] for r in per_rank],
        "model_state_bytes": [r["model_state_bytes"] for r in per_rank],
        "wire_by_axis": [r["wire_by_axis_per_step"][steps - 1] for r in per_rank],
    }
