"""``estimate``: the whole analytic model for one configuration, as a nested dict for the CLI.

All figures are bytes or FLOPs unless a key says otherwise (``*_gb`` = 10^9 bytes, the ZeRO
paper's unit). Per-rank figures are for the most loaded pipeline rank for memory and for one
rank of the first pipeline stage for communication. With context parallelism, gradients are
reduced and ZeRO partitions over the dp x cp ranks, as in Megatron-Core.

MoE models (Megatron-Core layout, :func:`params.expert_layout`): dense parameters (the
router included) are replicated over dp x cp, expert parameters over the expert-data-parallel
group ``edp = tp cp dp / (etp ep)``. Model states are computed for each group with its own
size -- ZeRO partitions each group's flat buffer over its own ranks, as Megatron-Core's
distributed optimizer does -- and gradient traffic is reported on axis ``dp`` for the dense
part and ``edp`` for the expert part. Expert all-to-alls (GShard, Lepikhin et al. 2020;
Switch, Fedus et al. 2021), the router and expert FLOPs and the routed activations
(:func:`.activations.moe_layer_activation_bytes`) are counted on MoE layers only, every
``moe_every``-th.

Options stated by this function (defaults: the behaviour before they existed):

- the vocabulary is padded to a multiple of ``make_vocab_size_divisible_by * tp`` (a field of
  the shape; Megatron-LM's ``_vocab_size_with_padding``, 128 there, 1 -- a multiple of tp --
  for the reference model) before every count: embedding, head, logit FLOPs, logits memory
  (``inputs.padded_vocab_size``; ``parameters.total_unpadded_vocab`` when it differs);
- ``accounting``: bytes per parameter of the model states (:mod:`.memory`: ``mixed_adam`` /
  ``zero16``, ``mixed_adam_fp32_grad`` / ``zero20``, ``fp32_adamw``, ``megatron``,
  ``deepspeed18``; ``megatron`` with ``zero_stage=1`` is Megatron-Core's distributed
  optimizer, 6 + 12/d bytes; ``deepspeed18`` with ``zero_stage=3`` adds DeepSpeed's
  largest-layer buffer, ``buffer``);
- ``attention``: ``"eager"`` (Korthikanti's count with the s x s scores) or ``"flash"`` (no
  s x s tensor kept; :mod:`.activations`);
- ``causal_flops``: ``"full"`` (the s^2 scores counted whole, Narayanan et al. 2021) or
  ``"half"`` (a causal mask halves them; :mod:`.flops`);
- ``logits_bytes``: 4 (fp32 logits, Megatron's default) or 2: the last stage's logits,
  ``memory.activations.last_stage_logits``;
- ``generate=N``: the KV cache of b = ``micro_batch`` sequences of ``seq_length`` prompt and
  N generated tokens, whole and per rank under tp and pp (``kv_cache``).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from . import activations, comm, flops, memory
from . import params as param_model
from .shape import (Shape, moe_layer_count,
                    require_nonneg_int, require_positive_int, shape_from)
from .estimate_states import (_add_layer_buffer, _model_states_block,
                              _moe_model_states_block)
from .kv_cache import kv_cache
from .estimate_traffic import _expert_comm, _routed_rows, per_layer_traffic


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


def _activations_by_recompute(shape: Shape, b: int, s: int, tp: int, sp: bool,
                              e: int, moe: dict | None = None,
                              attention: str = "eager") -> dict:
    """Activation bytes of one layer per rank for every recompute mode: Korthikanti et al.
    Table 2 (``korthikanti``: e-byte activations, 1-byte dropout masks) and the reference
    model's exact count (``reference_model``: no dropout, fused attention, LayerNorm
    statistics; the projection input a view of the kernel's output); for an MoE model also
    an MoE layer's (``*_moe``, :func:`.activations.moe_layer_activation_bytes` with the keywords
    ``moe``)."""
    out = {}
    arch = {"kv_hidden": shape.kv_hidden, "mlp": shape.mlp}
    for mode in activations.RECOMPUTE:
        out[mode] = {
            "korthikanti": activations.layer_activation_bytes(
                s, b, shape.h, shape.a, tp, sp, mode, shape.f, bytes_per_element=e,
                attention=attention, **arch),
            "reference_model": activations.reference_layer_activation_bytes(
                s, b, shape.h, shape.a, tp, sp and tp > 1, mode, shape.f,
                bytes_per_element=e, proj_input_copy=False, **arch)}
        if moe is not None:
            for kind in ("korthikanti", "reference_model"):
                out[mode][kind + "_moe"] = activations.moe_layer_activation_bytes(
                    out[mode][kind], recompute=mode, **moe)["total"]
    return out


def estimate(shape: Shape | Any | None = None, *, params: float | None = None,
             micro_batch: int = 1, global_batch: int | None = None,
             num_microbatches: int | None = None, tp: int = 1, pp: int = 1, dp: int = 1,
             cp: int = 1, ep: int = 1, vpp: int = 1, zero_stage: int = 0, sp: bool = False,
             recompute: str = "none", bytes_per_element: int = 2, cp_algorithm: str = "ring-attention",
             accounting: str | None = None, etp: int | None = None,
             capacity_factor: float | None = None, attention: str = "eager",
             causal_flops: str = "full", logits_bytes: int = 4,
             generate: int | None = None) -> dict:
    """Parameters, FLOPs, memory per rank and communication per axis for one configuration.

    Give a model ``shape`` (a :class:`Shape` or any object with its field names), or only the
    parameter count ``params=``, as in the ZeRO paper's examples:
    then the result holds the parameters, the 6/8 FLOPs-per-token rule, the ZeRO model states
    (with ``tp * pp`` model parallelism dividing the model) and the data-parallel traffic.

    ``global_batch`` (sequences) fixes the micro-batches per data-parallel rank,
    ``global_batch / (micro_batch * dp)``; otherwise ``num_microbatches`` (default 1).
    ``accounting`` names a :data:`memory.ACCOUNTINGS` entry for the selected ZeRO stage
    (default: ``fp32_adamw`` for 4-byte elements, else ``mixed_adam``).

    MoE: ``etp`` is the expert tensor-parallel size (0 or ``None``: ``tp``);
    ``capacity_factor`` overrides the shape's ``moe_capacity_factor`` (0: no capacity limit).
    ``ep`` must divide ``num_experts`` and ``ep * etp`` must divide ``tp * cp * dp``.

    ``attention``, ``causal_flops``, ``logits_bytes`` and ``generate``: see the module doc.
    """
    for name, v in (("micro_batch", micro_batch), ("tp", tp), ("pp", pp), ("dp", dp),
                    ("cp", cp), ("ep", ep), ("vpp", vpp)):
        require_positive_int(name, v)
    if shape is None and params is None:
        raise ValueError("give a model shape or params=")
    chosen = accounting or ("fp32_adamw" if bytes_per_element == 4 else "mixed_adam")
    chosen = memory.get_accounting(chosen).name
    if attention not in activations.ATTENTION:
        raise ValueError(f"attention={attention!r} must be one of "
                         f"{', '.join(activations.ATTENTION)}")
    if causal_flops not in flops.CAUSAL:
        raise ValueError(f"causal_flops={causal_flops!r} must be one of "
                         f"{', '.join(flops.CAUSAL)}")
    if logits_bytes not in (2, 4):
        raise ValueError(f"logits_bytes={logits_bytes!r} must be 4 (fp32) or 2 (bf16)")
    if generate is not None:
        require_nonneg_int("generate", generate)
    e = bytes_per_element
    m = _microbatches(micro_batch, dp, global_batch, num_microbatches)
    inputs = {"micro_batch": micro_batch, "num_microbatches": m,
              "global_batch": micro_batch * dp * m, "tp": tp, "pp": pp, "dp": dp, "cp": cp,
              "ep": ep, "vpp": vpp, "zero_stage": zero_stage, "sp": sp,
              "recompute": recompute, "bytes_per_element": e}

    if shape is None:
        if generate is not None:
            raise ValueError("generate= needs a model shape (give model=PRESET, not params=)")
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
    if capacity_factor is not None:
        shp = replace(shp, moe_capacity_factor=capacity_factor)
    unpadded = shp
    padded_v = shp.padded_vocab(tp)
    if padded_v != shp.V:
        shp = replace(shp, vocab_size=padded_v)
    inputs.update({"vocab_size": unpadded.V, "padded_vocab_size": padded_v,
                   "make_vocab_size_divisible_by": shp.make_vocab_size_divisible_by,
                   "attention": attention, "causal_flops": causal_flops,
                   "logits_bytes": logits_bytes})
    if not shp.gpt_style:
        inputs.update({"num_kv_heads": shp.kv_heads, "mlp": shp.mlp, "norm": shp.norm,
                       "bias": shp.bias})
    B = micro_batch * dp * m  # noqa: N806
    s_local = shp.s // cp if shp.s % cp == 0 else None
    if s_local is None:
        raise ValueError(f"cp={cp} does not divide seq_length={shp.s}")
    layout = param_model.expert_layout(shp, tp=tp, cp=cp, dp=dp, ep=ep, etp=etp)
    counts = param_model.param_counts(shp, pp, tp, ep, vpp, etp=etp)
    if padded_v != unpadded.V:
        counts["total_unpadded_vocab"] = param_model.total_params(unpadded)
    psi_rank = max(st["total"] for st in counts["stages"])
    largest_layer = param_model.largest_module_params(shp, tp, ep, etp=etp)
    layers = shp.num_layers // pp
    if shp.moe:
        inputs.update({"etp": layout["etp"], "edp": layout["edp"], "moe_every": shp.moe_every,
                       "moe_capacity_factor": shp.moe_capacity_factor,
                       "moe_top_k": shp.moe_top_k})

    dense4 = not shp.moe and shp.f == 4 * shp.h and shp.gpt_style
    c = causal_flops
    fl = {
        "forward_per_iteration": flops.shape_forward_flops(shp, B, causal=c),
        "training_per_iteration": flops.shape_training_flops(shp, B, causal=c),
        "training_per_iteration_recompute": flops.shape_training_flops(shp, B, recompute=True,
                                                                       causal=c),
        "megatron_eq3": flops.megatron_eq3_flops(B, shp.s, shp.l, shp.h, shp.V)
        if dense4 else None,
        "params_rule_6N": flops.params_rule_flops(param_model.active_params(shp), B * shp.s),
        "per_device_training": flops.shape_training_flops(shp, B, recompute=recompute == "full",
                                                          causal=c)
        / (tp * pp * dp * cp),
        "causal_flops": c,
    }

    arch = {"kv_hidden": shp.kv_hidden, "mlp": shp.mlp}
    per_layer = activations.layer_activation_bytes(s_local, micro_batch, shp.h, shp.a, tp, sp,
                                                   recompute, shp.f, bytes_per_element=e,
                                                   attention=attention, **arch)
    ref_layer = activations.reference_layer_activation_bytes(
        s_local, micro_batch, shp.h, shp.a, tp, sp, recompute, shp.f, bytes_per_element=e,
        **arch)
    sched = "interleaved" if vpp > 1 else "1f1b"
    first = param_model.stage_layer_indices(shp.num_layers, pp, vpp)[0]
    moe_kw = None
    if not shp.moe:
        act = {
            "per_layer_korthikanti": per_layer,
            "first_stage_korthikanti": activations.first_stage_activation_bytes(
                per_layer, shp.num_layers, pp, m, vpp, sched),
            "per_layer_reference_model": ref_layer,
            "first_stage_reference_model": activations.first_stage_activation_bytes(
                ref_layer, shp.num_layers, pp, m, vpp, sched),
        }
    else:
        tokens, _, rows = _routed_rows(shp, micro_batch, s_local, tp, sp)
        moe_kw = {"s": s_local, "b": micro_batch, "h": shp.h, "f": shp.f, "tp": tp,
                  "tokens": tokens, "rows": rows, "num_experts": shp.num_experts,
                  "etp": layout["etp"], "bytes_per_element": e, "mlp": shp.mlp}
        n_moe = moe_layer_count(shp, first)
        n_dense = len(first) - n_moe
        moe_act = activations.moe_layer_activation_bytes
        moe_terms = moe_act(per_layer, recompute=recompute, **moe_kw)
        moe_ref = moe_act(ref_layer, recompute=recompute, **moe_kw)["total"]

        def first_stage(dense_layer: float, moe_layer: float) -> float:
            # the first rank's layers summed, each as its kind, held for the micro-batches in
            # flight (Korthikanti et al. Sec. 4.2.3): one "layer" of that sum per stage
            return activations.first_stage_activation_bytes(
                n_dense * dense_layer + n_moe * moe_layer, pp, pp, m, vpp, sched)

        act = {
            "per_layer_korthikanti": per_layer,
            "per_moe_layer_korthikanti": moe_terms["total"],
            "first_stage_korthikanti": first_stage(per_layer, moe_terms["total"]),
            "per_layer_reference_model": ref_layer,
            "per_moe_layer_reference_model": moe_ref,
            "first_stage_reference_model": first_stage(ref_layer, moe_ref),
            "first_stage_moe_layers": n_moe,
            "first_stage_dense_layers": n_dense,
            "moe_layer_terms_korthikanti": moe_terms,
        }

    full = recompute == "full"
    tr: list[comm.Transfer] = []
    tr += comm.tp_traffic(micro_batch, s_local, shp.h, tp, layers, m, e, full, sp)
    if cp > 1:
        # K and V are kv_hidden wide (h without GQA): ring attention passes, and all-gather
        # CP gathers, this rank's kv_hidden / tp columns of them
        if cp_algorithm == "ring-attention":
            tr += comm.ring_attention_traffic(micro_batch, shp.s, shp.kv_hidden // tp, cp,
                                              layers, m, e, recompute=full)
        elif cp_algorithm == "ulysses":
            tr += comm.ulysses_traffic(micro_batch, shp.s, shp.h // tp, cp, layers, m, e,
                                       recompute=full)
        elif cp_algorithm == "allgather":
            gathers = ((1, 6),) if full else ((1, 4),)
            tr += comm.cp_allgather_traffic(micro_batch, s_local, shp.kv_hidden, cp, tp, layers,
                                            m, e, gathers)
        else:
            raise ValueError(f"cp_algorithm={cp_algorithm!r} must be ring-attention, ulysses or "
                             "allgather")
    expert_info = None
    if shp.moe:
        ep_tr, expert_info = _expert_comm(shp, layout, micro_batch, s_local, tp, sp,
                                          moe_layer_count(shp, first), m, e, full)
        tr += ep_tr
    if pp > 1:
        s_p2p = s_local // tp if sp and s_local % tp == 0 else s_local
        tr += comm.pipeline_p2p_traffic(micro_batch, s_p2p, shp.h, pp, m, 0, vpp,
                                        bytes_per_element=e)
    st0 = counts["stages"][0]
    grads = (("dp", dp * cp, st0["dense"] if shp.moe else st0["total"], ""),
             ("edp", layout["edp"], st0.get("expert", 0), "expert "))
    for axis, group, numel, what in grads:
        if group > 1 and numel:
            tr += [comm.Transfer(axis, t.op, t.group_size, t.message_bytes, t.count,
                                 what + t.what)
                   for t in comm.zero_traffic(numel, group, zero_stage, e, e)]

    act["per_layer_by_recompute"] = _activations_by_recompute(shp, micro_batch, s_local, tp,
                                                              sp, e, moe_kw, attention)
    act["attention"] = attention
    act["last_stage_logits"] = activations.logits_bytes(s_local, micro_batch, shp.V, tp,
                                                        logits_bytes)
    act["logits_note"] = (f"the last pipeline stage's logits of one micro-batch, "
                          f"{logits_bytes} bytes x b s/cp V'/tp (not in first_stage_*; with "
                          "pp = 1 the one stage holds both)")
    if shp.moe:
        states = _moe_model_states_block(counts["stages"], layout, zero_stage, chosen)
        _add_layer_buffer(states, zero_stage, chosen, largest_layer)
        act["note"] = ("per_layer_*: a dense layer; per_moe_layer_*: an MoE layer (router "
                       "logits and probabilities, the padded dispatch buffer of E*C rows or "
                       "k*T without capacity, the expert MLPs on those rows, the combine "
                       "buffer: moe_layer_terms_korthikanti); first_stage_*: the first "
                       "pipeline rank's layers, each counted as its kind")
        scope = ("one rank of the first pipeline stage, one iteration; dense gradients "
                 "reduced over dp x cp (axis dp), expert gradients over "
                 "edp = tp*cp*dp/(etp*ep) (axis edp)")
    else:
        states = _model_states_block(psi_rank, dp * cp, zero_stage, chosen)
        _add_layer_buffer(states, zero_stage, chosen, largest_layer)
        scope = "one rank of the first pipeline stage, one iteration; gradients reduced " \
                "over dp x cp"
    out_comm = {"per_layer": per_layer_traffic(shp, micro_batch, tp, cp, sp, recompute, e),
                "per_axis": comm.summarize(tr),
                "transfers": [t.as_dict() for t in tr],
                "scope": scope}
    if expert_info is not None:
        out_comm["expert"] = expert_info
    out = {
        "inputs": inputs,
        "parameters": counts,
        "flops": fl,
        "memory": {"model_states": states, "activations": act},
        "communication": out_comm,
    }
    if generate is not None:
        out["kv_cache"] = kv_cache(shp, micro_batch, generate, tp=tp, pp=pp, vpp=vpp,
                                   bytes_per_element=e)
    return out


