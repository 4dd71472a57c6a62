"""The communication block of ``estimate``: every transfer one rank of the first pipeline stage
makes in one iteration (tensor, context, expert, pipeline and gradient traffic), their totals
per axis, one layer's traffic under each way of splitting it, and how an MoE layer's tokens
are routed."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..layout import ConfigError, Layout
from ..options import Options
from . import comm, context, gqa, tensor
from .counting import Counting
from .estimate_blocks import Block, StageParams, optional
from .recompute_modules import repeats_dispatch
from .shape import Shape, exact_factor, expert_capacity, moe_layer_count
from .stages import layout_stage_indices

_SCOPE_DENSE = ("one rank of the first pipeline stage, one iteration; gradients reduced over "
                "dp x cp")
_SCOPE_MOE = ("one rank of the first pipeline stage, one iteration; dense gradients reduced "
              "over dp x cp (axis dp), expert gradients over edp = tp*cp*dp/(etp*ep) "
              "(axis edp)")
#: the context-parallel algorithms whose traffic estimate counts
CP_COUNTED = ("ring-attention", "ulysses", "allgather")


def routed_rows(shape: Shape, micro_batch: int, s_local: int, tp: int, sp: bool
                ) -> tuple[int, int | None, int]:
    """(T, C, R) of one rank and MoE layer per micro-batch: T the tokens it routes (its
    b * s/cp, divided by tp under sequence parallelism, which the layout's rules let tp
    divide), C = ceil(cf k T / E) the capacity (``None``: no limit) and R the rows of the
    dispatch buffer, E C with a capacity (padding included) or k T without."""
    tokens = micro_batch * s_local // (tp if sp and tp > 1 else 1)
    cap = expert_capacity(tokens, shape.num_experts, shape.moe_top_k,
                          shape.moe_capacity_factor)
    return tokens, cap, shape.moe_top_k * tokens if cap is None else shape.num_experts * cap


@dataclass(frozen=True)
class ExpertRouting(Block):
    """How the expert all-to-alls were counted on one rank (per micro-batch)."""

    tokens_per_rank: int
    top_k: int
    capacity_factor: float
    capacity_per_expert: int | None
    rows_per_all_to_all: int
    moe_layers_on_rank: int
    ep: int
    etp: int
    edp: int
    all_to_alls_per_moe_layer_per_micro_batch: int


def expert_transfers(shape: Shape, lay: Layout, sp: bool, s_local: int, full: bool,
                     e: int) -> tuple[list[comm.Transfer], ExpertRouting]:
    """All-to-all traffic of the expert-parallel group on one rank, and how it was counted.

    T = the tokens one rank routes per micro-batch: its b * s/cp tokens, divided by tp under
    sequence parallelism (Megatron-Core routes each rank's sequence-parallel shard). With a
    capacity factor the dispatch buffer holds E slots of C = ceil(cf k T / E) rows (Switch,
    Sec. 2.2; dropped tokens leave padding), without one k T rows. 2 all-to-alls forward and
    2 backward per MoE layer per micro-batch, 2 more with full recomputation (GShard,
    Lepikhin et al. 2020; Switch, Fedus et al. 2021, Sec. 2.2)."""
    tokens, cap, rows = routed_rows(shape, lay.micro_batch_size, s_local, lay.tp, sp)
    moe_layers = moe_layer_count(shape, layout_stage_indices(shape.num_layers, lay)[0])
    cf, k = shape.moe_capacity_factor, shape.moe_top_k
    info = ExpertRouting(tokens, k, cf, cap, rows, moe_layers, lay.ep, lay.expert_tp, lay.edp,
                         6 if full else 4)
    tr = comm.expert_traffic(tokens, shape.h, lay.ep, moe_layers, lay.num_microbatches, k, e,
                             full, capacity_factor=exact_factor(cf) if cf else None,
                             num_experts=shape.num_experts)
    return [t for t in tr if t.count], info


def first_stage_layers(shape: Shape, lay: Layout) -> int:
    """Layers of the first pipeline rank (its chunks summed; an uneven first stage's own)."""
    return lay.stage_layers(shape.num_layers)[0]


def local_kv_width(shape: Shape, tp: int) -> int:
    """One tensor-parallel rank's K (or V) width: its share of the K/V heads, at least one
    whole head (when tp exceeds them the t / num_kv_heads ranks of a query group each hold
    its K/V activations, from the gathered QKV output: :mod:`.gqa`)."""
    return gqa.local_kv_heads(shape, tp) * (shape.h // shape.a)


def cp_transfers(shape: Shape, lay: Layout, algorithm: str, s_local: int, full: bool,
                 e: int) -> list[comm.Transfer]:
    """Context-parallel attention traffic. K and V are kv_hidden wide (h without GQA), this
    rank's ``local_kv_width`` of them under tp: ring attention passes them (Liu et al. 2023),
    all-gather CP gathers them; DeepSpeed-Ulysses (Jacobs et al. 2023) moves q and the
    output h / tp wide, k and v at that width."""
    b, m, t = lay.micro_batch_size, lay.num_microbatches, lay.tp
    layers, kv = first_stage_layers(shape, lay), local_kv_width(shape, t)
    if algorithm == "ring-attention":
        return comm.ring_attention_traffic(b, shape.s, kv, lay.cp, layers, m, e,
                                           recompute=full)
    if algorithm == "ulysses":
        return comm.ulysses_traffic(b, shape.s, shape.h // t, lay.cp, layers, m, e,
                                    recompute=full, h_kv=kv)
    if algorithm == "allgather":
        gathers = ((1, 6),) if full else ((1, 4),)
        return comm.cp_allgather_traffic(b, s_local, kv, lay.cp, 1, layers, m, e, gathers)
    raise ConfigError(f"cp_algorithm={algorithm!r} is not counted by estimate (choose from "
                      f"{', '.join(CP_COUNTED)})")


def gradient_transfers(shape: Shape, lay: Layout, stage0: StageParams, zero_stage: int,
                       e: int) -> list[comm.Transfer]:
    """ZeRO / DDP traffic of the first stage's gradients (Rajbhandari et al. 2020, Sec. 7):
    the dense part over dp x cp (axis dp), an MoE model's expert part over edp."""
    grads = (("dp", lay.dp_cp, stage0.dense if shape.moe else stage0.total, ""),
             ("edp", lay.edp, stage0.expert or 0, "expert "))
    out = []
    for axis, group, numel, what in grads:
        if group > 1 and numel:
            out += [comm.Transfer(axis, t.op, t.group_size, t.message_bytes, t.count,
                                  what + t.what)
                    for t in comm.zero_traffic(numel, group, zero_stage, e, e)]
    return out


@dataclass(frozen=True)
class Communication(Block):
    """One rank's traffic: ``transfers`` (every collective and send), ``per_axis`` (their
    totals: axis -> count, message_bytes, wire_bytes), ``per_layer`` (one layer and
    micro-batch under each way of splitting it) and, on MoE models, the routing."""

    per_layer: dict[str, Any]
    per_axis: dict[str, dict]
    transfers: list[comm.Transfer]
    scope: str
    expert: ExpertRouting | None = optional()


def communication_block(shape: Shape, lay: Layout, options: Options, counting: Counting,
                        s_local: int, stage0: StageParams) -> Communication:
    """The communication block of ``shape`` (vocabulary padded) on one rank of the first
    pipeline stage: tensor (Megatron, with SP), context, expert, pipeline p2p and gradients."""
    e, sp, full = counting.bytes_per_element, options.tensor.sp, options.recompute == "full"
    b, m = lay.micro_batch_size, lay.num_microbatches
    layers = first_stage_layers(shape, lay)
    tr = comm.tp_traffic(b, s_local, shape.h, lay.tp, layers, m, e, full, sp) + \
        gqa.qkv_gather_transfers(shape, b, s_local, lay.tp, options.recompute, e, layers * m)
    if lay.cp > 1:
        tr += cp_transfers(shape, lay, options.context.cp_algorithm, s_local, full, e)
    routing = None
    if shape.moe:
        ep_tr, routing = expert_transfers(shape, lay, sp, s_local, repeats_dispatch(options),
                                          e)
        tr += ep_tr
    if lay.pp > 1:
        s_p2p = s_local // lay.tp if sp and s_local % lay.tp == 0 else s_local
        tr += comm.pipeline_p2p_traffic(b, s_p2p, shape.h, lay.pp, m, 0, lay.vpp,
                                        bytes_per_element=e)
    tr += gradient_transfers(shape, lay, stage0, options.data.zero_stage, e)
    return Communication(
        per_layer=per_layer_traffic(shape, b, lay.tp, lay.cp, sp, options.recompute, e),
        per_axis=comm.summarize(tr), transfers=tr,
        scope=_SCOPE_MOE if shape.moe else _SCOPE_DENSE, expert=routing)


def per_layer_traffic(shape: Shape, micro_batch: int, tp: int, cp: int, sp: bool,
                      recompute: str, e: int) -> dict:
    """One rank's traffic for one transformer layer and one micro-batch, forward and backward
    (and the recomputed forward), under each way of splitting a layer that parbench models,
    at this configuration's degrees: Megatron TP and TP + SP (``tensor.megatron_layer_traffic``:
    SP counts the column-parallel inputs' backward re-gather; both the GQA QKV gather when
    tp > num_kv_heads, ``analytic.gqa``; ``paper`` is Korthikanti et al.'s 4 all-reduces or 4
    all-gather + reduce-scatter pairs), and over the cp ranks ring attention,
    DeepSpeed-Ulysses and all-gather CP (``context.attention_traffic``) on this rank's h / tp
    of the width. Each entry: {axis: {count, message_bytes, wire_bytes}}."""
    b, s, h = micro_batch, shape.s, shape.h
    out: dict[str, Any] = {"scope": "one rank, one layer, one micro-batch (fwd + bwd"
                                    + (" + recompute" if recompute != "none" else "") + ")"}
    if tp > 1:
        kv = gqa.qkv_gather_transfers(shape, b, s // cp, tp, recompute, e)
        out["tp"] = comm.summarize(tensor.megatron_layer_traffic(b, s // cp, h, tp, recompute,
                                                                 False, e) + kv)
        if (s // cp) % tp == 0:
            out["tp_sp"] = comm.summarize(tensor.megatron_layer_traffic(
                b, s // cp, h, tp, recompute, True, e) + kv)
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
            # Q and the output h / tp wide; K and V this rank's share of the K/V heads
            out[key] = comm.summarize(context.attention_traffic(
                kind, b, s, h // tp, cp, 1, 1, 1, e, again,
                h_kv=local_kv_width(shape, tp)))
    return out
