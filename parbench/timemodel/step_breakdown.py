"""A priced step's parts and the :class:`StepTime` assembled from them (``model.py`` prices
the parts): the exposed communication per axis, the bubble, throughput and MFU (Korthikanti
et al. 2022, Sec. 6 / App. A), memory per rank, notes and the breakdown."""
from __future__ import annotations

import math
from functools import lru_cache
from dataclasses import dataclass

from ..analytic import flops as aflops
from ..schedules import ScheduleSpec, WeightRule
from .costs import _Costs
from .dp_memory import memory_per_rank
from .training import StepTime, Training
from .profile import Profile


@dataclass
class StageCosts:
    """One micro-batch's costs: a dense layer's, the embedding's, the head's, and each
    virtual stage's (its layers, the embedding on the first, the head on the last)."""

    layer: _Costs
    emb: _Costs
    head: _Costs
    per_stage: list[_Costs]


@dataclass
class PipelineRun:
    """The pipeline part of a step: the schedule's spec (None: one stage, no schedule runs)
    and weight rule, the makespan with and without the p2p latency, each rank's busy time,
    and one p2p transfer's seconds."""

    spec: ScheduleSpec | None
    rule: WeightRule
    makespan: float
    makespan0: float
    busy_ranks: list[float]
    p2p: float


@dataclass
class CriticalSync:
    """The critical (busiest) pipeline rank, its costs over the step's micro-batches, and
    what follows its pipeline: the optimizer step, the data-parallel sync (exposed, total,
    detail) and the loss all-reduce."""

    rank: int
    rank_costs: _Costs
    opt_s: float
    dp_exposed: float
    dp_total: float
    dp_detail: dict
    loss_s: float


@lru_cache(maxsize=1024)
def _model_flops(shape, batch: int) -> int:
    """The step's model FLOPs (``analytic.flops.shape_training_flops``, no recomputation),
    cached: every layout of one planner search has the same model and batch."""
    return aflops.shape_training_flops(shape, batch, recompute=False)


def step_time(shape, trn: Training, profile: Profile, stages: StageCosts,
               pipe: PipelineRun, sync: CriticalSync) -> StepTime:
    """The StepTime: the step, the critical rank's compute and exposed communication, the
    bubble, throughput and MFU, memory, notes and the breakdown."""
    lay, rc0 = trn.layout, sync.rank_costs
    step = pipe.makespan + sync.dp_exposed + sync.opt_s + sync.loss_s
    exposed = _exposed_comm(trn, pipe, sync)
    bubble = max(pipe.makespan0 - pipe.busy_ranks[sync.rank], 0.0) if lay.pp > 1 else 0.0
    heaviest = max(exposed, key=exposed.get) if any(x > 0 for x in exposed.values()) \
        else None
    # ---- throughput, MFU
    B = lay.micro_batch_size * lay.num_microbatches * lay.dp
    tokens = B * shape.s
    model_flops = _model_flops(shape, B)
    peak = profile.peak_flops(trn.dtype)
    mfu = model_flops / (step * lay.world_size * peak) if step > 0 else 0.0
    # ---- memory
    mem, mem_detail = memory_per_rank(shape, trn)
    fits = mem <= (profile.memory_bytes or math.inf)
    breakdown = _breakdown(stages, pipe, sync, profile)
    breakdown.update({"model_flops": model_flops, "tokens_per_step": tokens,
                      "peak_flops": peak, "memory": mem_detail, "profile": profile.name})
    return StepTime(step_s=step, tokens_per_s=tokens / step if step > 0 else 0.0, mfu=mfu,
                    compute_s=rc0.f + rc0.b + rc0.w + sync.opt_s, recompute_s=rc0.rc,
                    bubble_s=bubble, exposed_comm_s=exposed, memory_per_rank_bytes=mem,
                    device_memory_bytes=profile.memory_bytes, fits=fits,
                    heaviest_axis=heaviest, notes=_notes(shape, profile, mem),
                    breakdown=breakdown)


def _exposed_comm(trn: Training, pipe: PipelineRun, sync: CriticalSync) -> dict:
    """Exposed communication per axis on the critical rank: its tp / cp / ep / pp time,
    the p2p latency's share of the makespan, the data-parallel sync and the loss."""
    lay, rc0 = trn.layout, sync.rank_costs
    p, n_dp = lay.pp, lay.dp * lay.cp
    exposed = {ax: v_ for ax, v_ in ((ax, rc0.comm_f.get(ax, 0.0) + rc0.comm_b.get(ax, 0.0))
                                     for ax in ("tp", "cp", "ep", "pp")) if v_ > 0}
    if p > 1:
        exposed["pp"] = exposed.get("pp", 0.0) + max(pipe.makespan - pipe.makespan0, 0.0)
    if n_dp > 1:
        exposed["dp"] = sync.dp_exposed
    if sync.loss_s:
        ax = "dp" if n_dp > 1 else ("pp" if p > 1 else "tp")
        exposed[ax] = exposed.get(ax, 0.0) + sync.loss_s
    return exposed


def _notes(shape, profile: Profile, mem: float) -> list[str]:
    """What the reader should know about the prediction: over memory, an uncalibrated
    profile, MoE's balance assumption."""
    notes: list[str] = []
    dev = profile.memory_bytes or math.inf
    if not mem <= dev:
        notes.append(f"over memory: {mem / 1e9:.1f} GB per rank > {dev / 1e9:.1f} GB of "
                     f"{profile.name}")
    if not profile.calibrated:
        notes.append(f"{profile.name} is an uncalibrated preset (datasheet and published "
                     "micro-benchmark figures, not measured here; `parbench reproduce "
                     "throughput` compares the A100 presets with published runs)")
    if shape.moe:
        notes.append("MoE: experts assumed balanced (k T rows per rank); routing and "
                     "dispatch costs approximate")
    return notes


def _breakdown(stages: StageCosts, pipe: PipelineRun, sync: CriticalSync,
               profile: Profile) -> dict:
    """The breakdown's per-micro-batch costs, pipeline, optimizer and sync terms (the
    caller adds FLOPs, tokens and memory, in the breakdown's order)."""
    dense_c, emb, head = stages.layer, stages.emb, stages.head
    return {
        "per_microbatch": {
            "layer": {"fwd_s": dense_c.f, "bwd_input_s": dense_c.b, "bwd_weight_s": dense_c.w,
                      "recompute_s": dense_c.rc, "comm_fwd_s": dict(dense_c.comm_f),
                      "comm_bwd_s": dict(dense_c.comm_b)},
            "embedding": {"fwd_s": emb.f, "bwd_s": emb.b + emb.w,
                          "comm_s": sum(emb.comm_f.values()) + sum(emb.comm_b.values())},
            "head": {"fwd_s": head.f, "bwd_s": head.b + head.w,
                     "comm_s": sum(head.comm_f.values()) + sum(head.comm_b.values())},
            "stages": [{"tf_s": c.tf, "tb_s": c.tb, "tw_s": c.w} for c in stages.per_stage],
        },
        "critical_rank": sync.rank,
        "pipeline_s": pipe.makespan,
        "p2p_s": pipe.p2p,
        "optimizer_s": sync.opt_s,
        "loss_allreduce_s": sync.loss_s,
        "dp": {"exposed_s": sync.dp_exposed, "total_s": sync.dp_total, **sync.dp_detail},
        "overlap_fraction": profile.overlap,
    }
