"""The calibration's driver: run each task on every rank at once, make the profile, add
further models' shapes, and check the compute model against a timed reference step."""
from __future__ import annotations

import os
import time
from typing import Callable

import torch.distributed as dist

from ..analytic.shape import shape_from
from ..launch import WorkerPool
from ..worker import in_torchrun, init_from_env
from ..timemodel import Training, predict_step
from ..timemodel.profile import COLLECTIVE_OPS, Profile
from .collectives import collective_task, overlap_task
from .compute import compute_task, reference_task
from .merge import build_profile
from .plan import Plan, model_config


def run_everywhere(fn, world_size: int, device: str, *args) -> list:
    """``fn(ctx, *args)`` on every rank: this process's job under torchrun, else a local
    pool (one thread per rank)."""
    if in_torchrun():
        ctx = init_from_env(device)
        mine = fn(ctx, *args)
        gathered: list = [None] * ctx.world_size
        dist.all_gather_object(gathered, mine)
        return gathered
    with WorkerPool(world_size, device=device, timeout_s=600.0, threads=1,
                    hang_timeout_s=600.0) as pool:
        return pool.run(fn, *args, timeout_s=3600.0, hang_timeout_s=600.0)


def _world() -> tuple[int | None, int | None]:
    """(world size, ranks per node) of the torchrun job this process is in (None: none)."""
    if not in_torchrun():
        return None, None
    world = int(os.environ["WORLD_SIZE"])
    return world, int(os.environ.get("LOCAL_WORLD_SIZE", world))


def calibrate(plan: Plan, world_size: int = 2, name: str | None = None,
              reference: tuple[str, int, int] | None = None,
              progress: Callable[[str], None] | None = None) -> Profile:
    """Measure and return a profile (not saved). ``reference``: (model preset, b, m) of a
    single-rank reference step to time as a check of the compute model."""
    say = progress or (lambda s: None)
    job, per_node = _world()
    world_size = job or world_size
    ranks_per_node = per_node or world_size
    t0 = time.time()
    say(f"compute: GEMMs ({len(plan.gemm_shapes()) + len(plan.square_sizes)} shapes), "
        f"attention, memory, overheads, AdamW on {world_size} ranks at once")
    compute = run_everywhere(compute_task, world_size, plan.device, plan)
    coll, overlap = _communication(plan, world_size, say, t0)
    extra = {}
    if reference is not None:
        model_name, b, m = reference
        say(f"reference step: {model_name}, {m} micro-batches of {b}, one rank each")
        secs = run_everywhere(reference_task, world_size, plan.device, model_name, b, m,
                              plan.min_time_s * 5, plan.repeats)
        extra["reference_step"] = {"model": model_name, "micro_batch_size": b,
                                   "num_microbatches": m, "seconds": max(secs),
                                   "per_rank_s": secs}
    extra["calibration_seconds"] = time.time() - t0
    default = "cuda-local" if plan.device.startswith("cuda") else "cpu-local"
    return build_profile(name or default, plan, compute, coll, min(overlap), world_size,
                         ranks_per_node, extra)


def _communication(plan: Plan, world_size: int, say, t0: float) -> tuple[list, list[float]]:
    """The collectives' raw points and the overlap fractions, per rank; on one rank nothing
    to measure (no points; the overlap left at 1.0 -- ``with_links_of`` can take a preset's)."""
    if world_size < 2:
        say("collectives: not measured (one rank)")
        return [], [1.0]
    say(f"collectives: {', '.join(COLLECTIVE_OPS)} on groups of "
        f"{', '.join(map(str, plan.group_sizes or range(2, world_size + 1)))} ranks, "
        f"{len(plan.message_bytes)} message sizes ({time.time() - t0:.0f} s so far)")
    coll = run_everywhere(collective_task, world_size, plan.device, plan)
    say(f"overlap of an all-reduce with a GEMM loop ({time.time() - t0:.0f} s so far)")
    return coll, run_everywhere(overlap_task, world_size, plan.device, plan)


def with_links_of(profile: Profile, preset: Profile) -> None:
    """A one-rank profile (one GPU: nothing to measure the links with) takes the links,
    collectives, overlap and node size of ``preset`` (its datasheet figures), and says so
    in ``meta['communication_from']``; what it measured (compute, memory) stays its own."""
    profile.links = dict(preset.links)
    profile.collectives = {lk: {op: dict(f) for op, f in ops.items()}
                           for lk, ops in preset.collectives.items()}
    profile.overlap, profile.p2p_blocking = preset.overlap, preset.p2p_blocking
    profile.ranks_per_node = preset.ranks_per_node
    profile.meta["communication_from"] = (f"{preset.name} (not measured: "
                                          f"{profile.meta.get('world_size', 1)} rank)")


def add_model_shapes(profile: Profile, plans: list[Plan], world_size: int, base: Plan
                     ) -> None:
    """Time further models' GEMM and attention shapes (one plan each, at ``base``'s repeats)
    and add those the profile lacks."""
    for p in plans:
        p.square_sizes = ()
        p.min_time_s, p.repeats = base.min_time_s, base.repeats
        have = {(g["m"], g["n"], g["k"], g["dtype"]) for g in profile.gemms}
        for r in run_everywhere(compute_task, world_size, base.device, p):
            for g in r["gemms"]:
                if (g["m"], g["n"], g["k"], g["dtype"]) not in have:
                    profile.gemms.append(g)
                    have.add((g["m"], g["n"], g["k"], g["dtype"]))
            profile.attention += [a for a in r["attention"] if a not in profile.attention]
    profile.__post_init__()


def reference_check(profile: Profile) -> dict | None:
    """The compute model against the timed single-rank reference step (if one was timed)."""
    ref = profile.meta.get("reference_step")
    if not ref:
        return None
    shape = shape_from(model_config(ref["model"]))
    training = Training.of(micro_batch_size=ref["micro_batch_size"],
                           num_microbatches=ref["num_microbatches"], dtype="fp32")
    st = predict_step(shape, training, profile)
    return {**{k: ref[k] for k in ("model", "micro_batch_size", "num_microbatches")},
            "measured_s": ref["seconds"], "predicted_s": st.step_s,
            "error": st.step_s / ref["seconds"] - 1}
