"""What an expert-parallel row reports beside its closed forms: the routing of the last
checked step (tokens routed and dropped per expert over all ranks, micro-batches and MoE
layers; the load imbalance max/mean; the Switch aux loss and ST-MoE z-loss, unscaled means
over the routing groups; the capacity) and the all-to-all traffic per MoE layer and
micro-batch as the ledger saw it (calls, message bytes, wire bytes)."""
from __future__ import annotations

import statistics

import torch.distributed as dist

from parbench import comm


def _summed(lists: list[list[int]]) -> list[int]:
    return [sum(v) for v in zip(*lists)] if lists else []


class StepStats:
    """Per checked step, plain numbers only (nothing a model-state tracker would count)."""

    def __init__(self):
        self.by_step: dict[int, dict] = {}

    def record(self, step: int, per_layer: list[list[dict]], ledger) -> None:
        flat = [s for layer in per_layer for s in layer]
        if not flat:
            return
        a2a = [r for r in (ledger.records if ledger is not None else [])
               if r.axis == "ep" and r.op == "all_to_all"]
        self.by_step[step] = {
            "load": _summed([s["load"] for s in flat]),
            "dropped": _summed([s["dropped"] for s in flat]),
            "aux_loss": statistics.mean(s["aux_loss"] for s in flat),
            "z_loss": statistics.mean(s["z_loss"] for s in flat),
            "capacity": max(s["capacity"] for s in flat),
            "layer_microbatches": len(flat),
            "a2a_calls": len(a2a),
            "a2a_message_bytes": sorted({r.message_bytes for r in a2a}),
            "a2a_wire_bytes": sum(r.wire_bytes for r in a2a),
        }

    def last(self, steps: int) -> dict | None:
        checked = [s for s in self.by_step if s < steps]
        return self.by_step[max(checked)] if checked else None


def _per_expert(values: list[int]) -> str:
    return "/".join(str(v) for v in values)


def _one_or_all(sizes: list[int]):
    """One message size as a number; several (a bug) joined; none as None."""
    if len(sizes) == 1:
        return sizes[0]
    return "/".join(str(b) for b in sizes) or None


def gather_last(stats: StepStats, ctx) -> tuple[dict | None, list[dict]]:
    """This rank's figures of the last checked step and every rank's that has some
    (a collective, outside the ledger)."""
    mine = stats.last(ctx.run.steps)
    every: list = [None] * dist.get_world_size()
    with comm.unrecorded():
        dist.all_gather_object(every, mine)
    return mine, [e for e in every if e]


def row_metrics(stats: StepStats, ctx, predicted: dict) -> dict:
    """The row's expert figures, every rank's routing merged (collective, outside the
    ledger)."""
    mine, every = gather_last(stats, ctx)
    if not every:
        return {}
    load = _summed([e["load"] for e in every])
    dropped = _summed([e["dropped"] for e in every])
    own = every[0] if mine is None else mine
    per = max(own["layer_microbatches"], 1)
    mean_load = sum(load) / len(load)
    return {
        "tokens_routed_per_expert": _per_expert(load),
        "tokens_dropped_per_expert": _per_expert(dropped),
        "drop_fraction": sum(dropped) / sum(load) if sum(load) else 0.0,
        "expert_load_imbalance": max(load) / mean_load if mean_load else None,
        "aux_loss": statistics.mean(e["aux_loss"] for e in every),
        "z_loss": statistics.mean(e["z_loss"] for e in every),
        "capacity": own["capacity"],
        "capacity_predicted": predicted.get("capacity"),
        "a2a_per_moe_layer": own["a2a_calls"] / per,
        "a2a_per_moe_layer_predicted": predicted.get("a2a_per_moe_layer_per_microbatch"),
        "a2a_message_bytes": _one_or_all(own["a2a_message_bytes"]),
        "a2a_message_bytes_predicted": predicted.get("a2a_message_bytes"),
        "a2a_wire_bytes_per_moe_layer": own["a2a_wire_bytes"] / per,
        "a2a_wire_bytes_per_moe_layer_predicted": predicted.get("a2a_wire_bytes_per_moe_layer"),
    }
