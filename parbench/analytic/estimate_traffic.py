"""The communication blocks of ``estimate``: the tokens an MoE layer routes and its padded
dispatch rows, the expert all-to-alls, and one layer's traffic per axis."""
from __future__ import annotations

from typing import Any

from . import comm
from .shape import (Shape, exact_factor, expert_capacity)


def _routed_rows(shp: Shape, micro_batch: int, s_local: int, tp: int, sp: bool
                 ) -> tuple[int, int | None, int]:
    """(T, C, R) of one rank and MoE layer per micro-batch: T the tokens it routes (its
    b * s/cp, divided by tp under sequence parallelism), C = ceil(cf k T / E) the capacity
    (``None``: no limit) and R the rows of the dispatch buffer, E C with a capacity (padding
    included) or k T without."""
    split = tp if sp and tp > 1 else 1
    if (micro_batch * s_local) % split:
        raise ValueError(f"sp with tp={tp} needs tp to divide the micro_batch*seq_length/cp="
                         f"{micro_batch * s_local} tokens a rank routes")
    tokens = micro_batch * s_local // split
    cap = expert_capacity(tokens, shp.num_experts, shp.moe_top_k, shp.moe_capacity_factor)
    return tokens, cap, shp.moe_top_k * tokens if cap is None else shp.num_experts * cap


def _expert_comm(shp: Shape, layout: dict, micro_batch: int, s_local: int, tp: int,
                 sp: bool, moe_layers: int, m: int, e: int, full: bool) -> tuple[list, dict]:
    """All-to-all traffic of the expert-parallel group on one rank, and how it was counted.

    T = the tokens one rank routes per micro-batch: its b * s/cp tokens, divided by tp under
    sequence parallelism (Megatron-Core routes each rank's sequence-parallel shard). With a
    capacity factor the dispatch buffer holds E slots of C = ceil(cf k T / E) rows (Switch,
    Sec. 2.2; dropped tokens leave padding), without one k T rows. 2 all-to-alls forward and
    2 backward per MoE layer per micro-batch, 2 more with full recomputation (GShard,
    Lepikhin et al. 2020; Switch, Fedus et al. 2021, Sec. 2.2)."""
    ep, E, k = layout["ep"], shp.num_experts, shp.moe_top_k  # noqa: N806
    tokens, cap, rows = _routed_rows(shp, micro_batch, s_local, tp, sp)
    cf = shp.moe_capacity_factor
    info = {"tokens_per_rank": tokens, "top_k": k, "capacity_factor": cf,
            "capacity_per_expert": cap, "rows_per_all_to_all": rows,
            "moe_layers_on_rank": moe_layers, "ep": ep, "etp": layout["etp"],
            "edp": layout["edp"],
            "all_to_alls_per_moe_layer_per_micro_batch": 6 if full else 4}
    tr = comm.expert_traffic(tokens, shp.h, ep, moe_layers, m, k, e, full,
                             capacity_factor=exact_factor(cf) if cf else None,
                             num_experts=E)
    return [t for t in tr if t.count], info


def per_layer_traffic(shape: Shape, micro_batch: int, tp: int, cp: int, sp: bool,
                      recompute: str, e: int) -> dict:
    """One rank's traffic for one transformer layer and one micro-batch, forward and backward
    (and the recomputed forward), under each way of splitting a layer that parbench models,
    at this configuration's degrees: Megatron TP and TP + SP (``tensor.megatron_layer_traffic``:
    SP counts the column-parallel inputs' backward re-gather; ``paper`` is Korthikanti et
    al.'s 4 all-reduces or 4 all-gather + reduce-scatter pairs), and over the cp ranks ring
    attention, DeepSpeed-Ulysses and all-gather CP (``context.attention_traffic``) on this
    rank's h / tp of the width. Each entry: {axis: {count, message_bytes, wire_bytes}}."""
    from . import context, tensor
    b, s, h = micro_batch, shape.s, shape.h
    out: dict[str, Any] = {"scope": "one rank, one layer, one micro-batch (fwd + bwd"
                                    + (" + recompute" if recompute != "none" else "") + ")"}
    if tp > 1:
        out["tp"] = comm.summarize(tensor.megatron_layer_traffic(b, s // cp, h, tp, recompute,
                                                                 False, e))
        if (s // cp) % tp == 0:
            out["tp_sp"] = comm.summarize(tensor.megatron_layer_traffic(
                b, s // cp, h, tp, recompute, True, e))
        paper = comm.summarize(comm.tp_traffic(b, s // cp, h, tp, 1, 1, e,
                                               recompute == "full", sp))
        out["paper_tp" + ("_sp" if sp else "")] = paper
    if cp > 1:
        again = recompute != "none"
        for kind, key in (("ring-attention", "cp_ring"), ("ulysses", "ulysses"),
                          ("allgather", "cp_allgather")):
            if kind == "ulysses" and shape.a % cp:
                out[key] = f"cp={cp} does not divide num_heads={shape.a}"
                continue
            # ring attention and all-gather CP move K and V: kv_hidden wide under GQA
            width = h // tp if kind == "ulysses" else shape.kv_hidden // tp
            out[key] = comm.summarize(context.attention_traffic(
                kind, b, s, width, cp, 1, 1, 1, e, again))
    return out
