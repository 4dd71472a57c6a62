"""``estimate``: the whole analytic model for one configuration, as a nested dict for the CLI.

All figures are bytes or FLOPs unless a key says otherwise (``*_gb`` = 10^9 bytes, the ZeRO
paper's unit). Per-rank figures are for the most loaded pipeline rank for memory and for one
rank of the first pipeline stage for communication. With context parallelism, gradients are
reduced and ZeRO partitions over the dp x cp ranks, as in Megatron-Core.
"""
from __future__ import annotations

from typing import Any

from . import activations, comm, flops, memory
from . import params as param_model
from .shape import GB, Shape, require_positive_int, shape_from


def _microbatches(micro_batch: int, dp: int, global_batch: int | None,
                  num_microbatches: int | None) -> int:
    if global_batch is None:
        return 1 if num_microbatches is None else num_microbatches
    if global_batch % (micro_batch * dp):
        raise ValueError(f"micro_batch*dp={micro_batch * dp} does not divide "
                         f"global_batch={global_batch}")
    m = global_batch // (micro_batch * dp)
    if num_microbatches is not None and num_microbatches != m:
        raise ValueError(f"num_microbatches={num_microbatches} does not match "
                         f"global_batch/(micro_batch*dp)={m}")
    return m


def _model_states_block(psi: float, dp: int, zero_stage: int, chosen: str) -> dict:
    block: dict[str, Any] = {
        "per_rank_params": psi,
        "by_accounting": {name: memory.zero_table(psi, dp, acc)
                          for name, acc in memory.ACCOUNTINGS.items()},
        "zero_paper_gb": {k: memory.round_sig(v / GB, 3)
                          for k, v in memory.zero_table(psi, dp, memory.MIXED_ADAM).items()},
        "units": "bytes; zero_paper_gb in GB = 1e9 bytes, 3 significant figures "
                 "(mixed_adam, K = 12)",
        "selected": {"zero_stage": zero_stage, "accounting": chosen},
    }
    if float(psi).is_integer():
        exact = memory.zero_model_states_exact(int(psi), dp, zero_stage, chosen)
        block["selected"].update({k: v.as_dict() for k, v in exact.items()})
    else:
        block["selected"]["paper"] = memory.zero_model_states(psi, dp, zero_stage,
                                                              chosen).as_dict()
    return block


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
            out[key] = comm.summarize(context.attention_traffic(
                kind, b, s, h // tp, cp, 1, 1, 1, e, again))
    return out


def _activations_by_recompute(shape: Shape, b: int, s: int, tp: int, sp: bool,
                              e: int) -> dict:
    """Activation bytes of one layer per rank for every recompute mode: Korthikanti et al.
    Table 2 (``korthikanti``: e-byte activations, 1-byte dropout masks) and the reference
    model's exact count (``reference_model``: no dropout, fused attention, LayerNorm
    statistics; the projection input a view of the kernel's output)."""
    out = {}
    for mode in activations.RECOMPUTE:
        out[mode] = {
            "korthikanti": activations.layer_activation_bytes(
                s, b, shape.h, shape.a, tp, sp, mode, shape.f, bytes_per_element=e),
            "reference_model": activations.reference_layer_activation_bytes(
                s, b, shape.h, shape.a, tp, sp and tp > 1, mode, shape.f,
                bytes_per_element=e, proj_input_copy=False)}
    return out


def estimate(shape: Shape | Any | None = None, *, params: float | None = None,
             micro_batch: int = 1, global_batch: int | None = None,
             num_microbatches: int | None = None, tp: int = 1, pp: int = 1, dp: int = 1,
             cp: int = 1, ep: int = 1, vpp: int = 1, zero_stage: int = 0, sp: bool = False,
             recompute: str = "none", bytes_per_element: int = 2, cp_algorithm: str = "ring",
             accounting: str | None = None) -> dict:
    """Parameters, FLOPs, memory per rank and communication per axis for one configuration.

    Give a model ``shape`` (a :class:`Shape` or any object with its field names), or only the
    parameter count ``params=``, as in the ZeRO paper's examples:
    then the result holds the parameters, the 6/8 FLOPs-per-token rule, the ZeRO model states
    (with ``tp * pp`` model parallelism dividing the model) and the data-parallel traffic.

    ``global_batch`` (sequences) fixes the micro-batches per data-parallel rank,
    ``global_batch / (micro_batch * dp)``; otherwise ``num_microbatches`` (default 1).
    ``accounting`` names a :data:`memory.ACCOUNTINGS` entry for the selected ZeRO stage
    (default: ``fp32_adamw`` for 4-byte elements, else ``mixed_adam``).
    """
    for name, v in (("micro_batch", micro_batch), ("tp", tp), ("pp", pp), ("dp", dp),
                    ("cp", cp), ("ep", ep), ("vpp", vpp)):
        require_positive_int(name, v)
    if shape is None and params is None:
        raise ValueError("give a model shape or params=")
    chosen = accounting or ("fp32_adamw" if bytes_per_element == 4 else "mixed_adam")
    memory.get_accounting(chosen)
    e = bytes_per_element
    m = _microbatches(micro_batch, dp, global_batch, num_microbatches)
    inputs = {"micro_batch": micro_batch, "num_microbatches": m,
              "global_batch": micro_batch * dp * m, "tp": tp, "pp": pp, "dp": dp, "cp": cp,
              "ep": ep, "vpp": vpp, "zero_stage": zero_stage, "sp": sp,
              "recompute": recompute, "bytes_per_element": e}

    if shape is None:
        psi = float(params)
        psi_rank = psi / (tp * pp)
        n_rank = int(round(psi_rank))
        return {
            "inputs": inputs,
            "parameters": {"total": psi},
            "flops": {"per_token_training": flops.params_rule_flops(psi, 1),
                      "per_token_training_recompute": flops.params_rule_flops(psi, 1, True)},
            "memory": {"model_states": _model_states_block(psi_rank, dp, zero_stage, chosen)},
            "communication": comm.summarize(
                comm.zero_traffic(n_rank, dp, zero_stage, e, e)) if dp > 1 else {},
        }

    shp = shape_from(shape)
    B = micro_batch * dp * m  # noqa: N806
    s_local = shp.s // cp if shp.s % cp == 0 else None
    if s_local is None:
        raise ValueError(f"cp={cp} does not divide seq_length={shp.s}")
    counts = param_model.param_counts(shp, pp, tp, ep, vpp)
    psi_rank = max(st["total"] for st in counts["stages"])
    layers = shp.num_layers // pp

    dense4 = not shp.moe and shp.f == 4 * shp.h
    fl = {
        "forward_per_iteration": flops.shape_forward_flops(shp, B),
        "training_per_iteration": flops.shape_training_flops(shp, B),
        "training_per_iteration_recompute": flops.shape_training_flops(shp, B, recompute=True),
        "megatron_eq3": flops.megatron_eq3_flops(B, shp.s, shp.l, shp.h, shp.V)
        if dense4 else None,
        "params_rule_6N": flops.params_rule_flops(param_model.active_params(shp), B * shp.s),
        "per_device_training": flops.shape_training_flops(
            shp, B, recompute=recompute == "full") / (tp * pp * dp * cp),
    }

    per_layer = activations.layer_activation_bytes(s_local, micro_batch, shp.h, shp.a, tp, sp,
                                                   recompute, shp.f, bytes_per_element=e)
    ref_layer = activations.reference_layer_activation_bytes(
        s_local, micro_batch, shp.h, shp.a, tp, sp, recompute, shp.f, bytes_per_element=e)
    sched = "interleaved" if vpp > 1 else "1f1b"
    act = {
        "per_layer_korthikanti": per_layer,
        "first_stage_korthikanti": activations.first_stage_activation_bytes(
            per_layer, shp.num_layers, pp, m, vpp, sched),
        "per_layer_reference_model": ref_layer,
        "first_stage_reference_model": activations.first_stage_activation_bytes(
            ref_layer, shp.num_layers, pp, m, vpp, sched),
    }

    full = recompute == "full"
    tr: list[comm.Transfer] = []
    tr += comm.tp_traffic(micro_batch, s_local, shp.h, tp, layers, m, e, full, sp)
    if cp > 1:
        if cp_algorithm == "ring":
            tr += comm.ring_attention_traffic(micro_batch, shp.s, shp.h // tp, cp, layers, m, e,
                                              recompute=full)
        elif cp_algorithm == "ulysses":
            tr += comm.ulysses_traffic(micro_batch, shp.s, shp.h // tp, cp, layers, m, e,
                                       recompute=full)
        elif cp_algorithm == "allgather":
            gathers = ((1, 6),) if full else ((1, 4),)
            tr += comm.cp_allgather_traffic(micro_batch, s_local, shp.h, cp, tp, layers, m, e,
                                            gathers)
        else:
            raise ValueError(f"cp_algorithm={cp_algorithm!r} must be ring, ulysses or "
                             "allgather")
    if shp.moe and ep > 1:
        tokens = micro_batch * s_local // (tp if sp else 1)
        tr += comm.expert_traffic(tokens, shp.h, ep, layers, m, shp.moe_top_k, e, full)
    if pp > 1:
        s_p2p = s_local // tp if sp and s_local % tp == 0 else s_local
        tr += comm.pipeline_p2p_traffic(micro_batch, s_p2p, shp.h, pp, m, 0, vpp,
                                        bytes_per_element=e)
    if dp * cp > 1:
        dp_tr = comm.zero_traffic(counts["stages"][0]["total"], dp * cp, zero_stage, e, e)
        tr += [comm.Transfer("dp", t.op, t.group_size, t.message_bytes, t.count, t.what)
               for t in dp_tr]

    act["per_layer_by_recompute"] = _activations_by_recompute(shp, micro_batch, s_local, tp,
                                                              sp, e)
    return {
        "inputs": inputs,
        "parameters": counts,
        "flops": fl,
        "memory": {"model_states": _model_states_block(psi_rank, dp * cp, zero_stage, chosen),
                   "activations": act},
        "communication": {"per_layer": per_layer_traffic(shp, micro_batch, tp, cp, sp,
                                                         recompute, e),
                          "per_axis": comm.summarize(tr),
                          "transfers": [t.as_dict() for t in tr],
                          "scope": "one rank of the first pipeline stage, one iteration; "
                                   "gradients reduced over dp x cp"},
    }
