"""What a pipeline case puts on the wire and holds as model states, per rank, in one step.

Traffic on axis pp (Narayanan et al. 2021, PTD-P Sec. 2.2): one b*s*h fp32 activation per
cross-rank stage boundary per micro-batch forward, one gradient of the same size backward --
every cross-rank transfer of ``Schedule.comm()`` -- plus, for the two-replica schedules
(Chimera, DualPipe), one exchange of each rank's flat gradients with its partner (S bytes
sent per rank = 2(n-1)/n * S at n = 2). Model states, in the tracker's categories
(``parbench.memory.live_model_states``): fp32 parameters and gradients of the stages a rank
holds, AdamW's two moments and one step counter per tensor, and what an asynchronous rule
keeps beside them (``extra``: weight versions, a reported mean gradient).
"""
from __future__ import annotations

from typing import Callable

import torch

from parbench.config import CaseConfig
from parbench.schedules import Schedule
from parbench.scheme import Prediction

#: ``extra(case, schedule, rank, counts) -> {category: bytes}`` added to the synchronous figures
ExtraStates = Callable[[CaseConfig, Schedule, int, dict], dict]


def stage_counts(cfg, stage: int, num_stages: int) -> tuple[int, int]:
    """(parameter elements, parameter tensors) of one stage, without allocating weights."""
    from parbench.model import Block, Embedding, Head, stage_layers
    lo, hi = stage_layers(cfg.num_layers, num_stages, stage)
    with torch.device("meta"):
        parts = [Block(cfg) for _ in range(lo, hi)]
        if stage == 0:
            parts.append(Embedding(cfg))
        if stage == num_stages - 1:
            parts.append(Head(cfg))
    tensors = [p for mod in parts for p in mod.parameters()]
    return sum(p.numel() for p in tensors), len(tensors)


def pipeline_prediction(case: CaseConfig, schedule: Schedule,
                        extra: ExtraStates | None = None) -> Prediction:
    """Per-rank p2p wire bytes and model-state bytes of one step (exact, fp32)."""
    cfg, par, run = case.model, case.parallel, case.run
    act_bytes = par.micro_batch_size * cfg.seq_length * cfg.hidden_size * 4
    num_stages = schedule.num_stages
    counts = {s: stage_counts(cfg, s, num_stages) for s in range(num_stages)}
    sent = [0] * schedule.p
    for transfer in schedule.comm():
        sent[transfer.src_rank] += act_bytes
    two_replicas = len(schedule.pipes) > 1
    per_rank_wire, per_rank_states = [], []
    for rank in range(schedule.p):
        held = schedule.stages_of(rank)
        numel = sum(counts[s][0] for _, s in held)
        ntensors = sum(counts[s][1] for _, s in held)
        wire = sent[rank] + (4 * numel if two_replicas else 0)
        per_rank_wire.append({"pp": float(wire)})
        states = {"params": 4 * numel, "grads": 4 * numel,
                  "optimizer": 8 * numel + 4 * ntensors if run.optimizer == "adamw" else 0}
        if extra is not None:
            for category, nbytes in extra(case, schedule, rank, counts).items():
                states[category] = states.get(category, 0) + nbytes
        per_rank_states.append(states)
    return Prediction(wire_bytes=per_rank_wire, model_state_bytes=per_rank_states,
                      figures={"p2p_bytes_per_transfer": act_bytes,
                               "schedule": {"name": schedule.name, "p": schedule.p,
                                            "m": schedule.m, "v": schedule.v,
                                            "num_stages": num_stages}})
