"""The activation block of ``estimate``: one layer's bytes per rank (Korthikanti et al. 2022,
Table 2, and the reference model's exact count), the first pipeline rank's layers held for
the micro-batches in flight (Sec. 4.2.3), every recompute mode, the last stage's logits; on
MoE models the routed terms of an MoE layer (:func:`.activations.moe_layer_activation_bytes`)
counted on MoE layers only."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..layout import Layout
from ..options import Options
from . import activations
from .counting import Counting
from .estimate_blocks import Block, optional
from .estimate_traffic import routed_rows
from .params import mtp_layer_is_moe
from .recompute_modules import check_modules
from .shape import Shape, moe_layer_count
from .stages import layout_stage_indices

_MOE_NOTE = ("per_layer_*: a dense layer; per_moe_layer_*: an MoE layer (router logits and "
             "probabilities, the padded dispatch buffer of E*C rows or k*T without capacity, "
             "the expert MLPs on those rows, the combine buffer: moe_layer_terms_korthikanti); "
             "first_stage_*: the first pipeline rank's layers, each counted as its kind")


@dataclass(frozen=True)
class Activations(Block):
    """Activation bytes per rank. ``per_layer_*``: one (dense) layer and micro-batch;
    ``first_stage_*``: the first pipeline rank at its peak (not the logits, which the last
    stage holds: ``last_stage_logits``); ``per_layer_by_recompute``: mode -> count -> bytes.
    MoE models add an MoE layer's count (``per_moe_layer_*``), its terms and the first rank's
    layers of each kind."""

    per_layer_korthikanti: float
    first_stage_korthikanti: float
    per_layer_reference_model: float
    first_stage_reference_model: float
    per_layer_by_recompute: dict[str, dict[str, float]]
    attention: str
    last_stage_logits: float
    logits_note: str
    per_moe_layer_korthikanti: float | None = optional()
    per_moe_layer_reference_model: float | None = optional()
    first_stage_moe_layers: int | None = optional()
    first_stage_dense_layers: int | None = optional()
    moe_layer_terms_korthikanti: dict[str, float] | None = optional()
    note: str | None = optional()
    last_stage_mtp: float | None = optional()

    def as_dict(self) -> dict:
        d = super().as_dict()  # the order the figures were always printed in
        order = ("per_layer_korthikanti", "per_moe_layer_korthikanti",
                 "first_stage_korthikanti", "per_layer_reference_model",
                 "per_moe_layer_reference_model", "first_stage_reference_model",
                 "first_stage_moe_layers", "first_stage_dense_layers",
                 "moe_layer_terms_korthikanti", "per_layer_by_recompute", "attention",
                 "last_stage_logits", "logits_note", "last_stage_mtp", "note")
        return {k: d[k] for k in order if k in d}


def _layer(shape: Shape, lay: Layout, sp: bool, mode: str, counting: Counting,
           s_local: int, view: bool = False,
           modules: frozenset[str] = frozenset({"core_attn"})) -> tuple[float, float]:
    """One dense layer's bytes: Korthikanti's count (e-byte activations, 1-byte dropout
    masks) and the reference model's (no dropout, fused attention, LayerNorm statistics).
    ``view``: the reference model's projection input counted as a view of the kernel's
    output (``proj_input_copy=False``, the table by recompute mode); otherwise as a copy."""
    b, t, e = lay.micro_batch_size, lay.tp, counting.bytes_per_element
    arch = shape.attention_keywords()
    kor = activations.layer_activation_bytes(s_local, b, shape.h, shape.a, t, sp, mode,
                                              shape.f, bytes_per_element=e,
                                              attention=counting.attention,
                                              modules=modules, **arch)
    ref_kw = {"proj_input_copy": False} if view else {}
    ref = activations.reference_layer_activation_bytes(
        s_local, b, shape.h, shape.a, t, (sp and t > 1) if view else sp, mode, shape.f,
        bytes_per_element=e, modules=modules, **ref_kw, **arch)
    return kor, ref


def _moe_keywords(shape: Shape, lay: Layout, sp: bool, counting: Counting,
                  s_local: int) -> dict[str, Any]:
    """The keywords of :func:`.activations.moe_layer_activation_bytes` for this rank."""
    tokens, _, rows = routed_rows(shape, lay.micro_batch_size, s_local, lay.tp, sp)
    return {"s": s_local, "b": lay.micro_batch_size, "h": shape.h, "f": shape.f,
            "tp": lay.tp, "tokens": tokens, "rows": rows, "num_experts": shape.num_experts,
            "etp": lay.expert_tp, "bytes_per_element": counting.bytes_per_element,
            "mlp": shape.mlp, "expert_f": shape.expert_f,
            "shared_f": shape.moe_shared_expert_size}


def _by_recompute(shape: Shape, lay: Layout, sp: bool, counting: Counting, s_local: int,
                  moe: dict | None) -> dict[str, dict[str, float]]:
    """One layer's bytes for every recompute mode (``moe`` holds the selective modules);
    for an MoE model an MoE layer's too (``*_moe``)."""
    out = {}
    for mode in activations.RECOMPUTE:
        kor, ref = _layer(shape, lay, sp, mode, counting, s_local, view=True,
                          modules=moe["modules"])
        out[mode] = {"korthikanti": kor, "reference_model": ref}
        if "num_experts" in moe:
            for kind in ("korthikanti", "reference_model"):
                out[mode][kind + "_moe"] = activations.moe_layer_activation_bytes(
                    out[mode][kind], recompute=mode, **moe)["total"]
    return out


def _first_stage(shape: Shape, lay: Layout, dense_layer: float,
                 moe_layer: float | None = None) -> float:
    """The first rank's layers held for the micro-batches in flight (Korthikanti et al.
    Sec. 4.2.3; the interleaved schedule with vpp > 1); on an MoE model or with an uneven
    first stage each of its layers counted (as its kind), summed, and that sum taken as one
    "layer" per stage."""
    sched = "interleaved" if lay.vpp > 1 else "1f1b"
    m = lay.num_microbatches
    if moe_layer is None and not lay.uneven:
        return activations.first_stage_activation_bytes(dense_layer, shape.num_layers, lay.pp,
                                                        m, lay.vpp, sched)
    first = layout_stage_indices(shape.num_layers, lay)[0]
    n_moe = moe_layer_count(shape, first) if moe_layer is not None else 0
    held = (len(first) - n_moe) * dense_layer + n_moe * (moe_layer or 0.0)
    return activations.first_stage_activation_bytes(held, lay.pp, lay.pp, m, lay.vpp, sched)


def _mtp(shape: Shape, lay: Layout, sp: bool, layer: float, logits: float,
         counting: Counting, s_local: int) -> float:
    """The multi-token prediction modules' activations of one micro-batch on the last stage
    (DeepSeek-V3 Sec. 2.2): per module its layer (``layer``: Korthikanti's count of the last
    layer's kind, :func:`.params.mtp_layer_is_moe`), the projection's [h; emb] input (2h per
    token; split over tp under SP, as a layer's input) and its logits (as the main head's);
    like ``last_stage_logits`` not added to the first stage's peak."""
    proj_in = 2 * shape.h * s_local * lay.micro_batch_size * counting.bytes_per_element
    return shape.mtp_layers * (layer + proj_in / (lay.tp if sp else 1) + logits)


def activation_block(shape: Shape, lay: Layout, options: Options, counting: Counting,
                     s_local: int) -> Activations:
    """The activation block of ``shape`` (vocabulary padded) on one rank."""
    sp, mode, mods = options.tensor.sp, options.recompute, options.selective_modules
    check_modules(shape, lay, mods if mode == "selective" else frozenset())
    kor, ref = _layer(shape, lay, sp, mode, counting, s_local, modules=mods)
    moe = {**_moe_keywords(shape, lay, sp, counting, s_local), "modules": mods} \
        if shape.moe else None
    logits = counting.logits_bytes
    common = dict(
        per_layer_korthikanti=kor, per_layer_reference_model=ref,
        per_layer_by_recompute=_by_recompute(shape, lay, sp, counting, s_local,
                                             moe or {"modules": mods}),
        attention=counting.attention,
        last_stage_logits=activations.logits_bytes(s_local, lay.micro_batch_size, shape.V,
                                                   lay.tp, logits),
        logits_note=(f"the last pipeline stage's logits of one micro-batch, {logits} bytes "
                     "x b s/cp V'/tp (not in first_stage_*; with pp = 1 the one stage holds "
                     "both)"))
    terms = activations.moe_layer_activation_bytes(kor, recompute=mode, **moe) if moe else None
    if shape.mtp_layers:
        layer = terms["total"] if mtp_layer_is_moe(shape) else kor
        common["last_stage_mtp"] = _mtp(shape, lay, sp, layer, common["last_stage_logits"],
                                        counting, s_local)
    if moe is None:
        return Activations(first_stage_korthikanti=_first_stage(shape, lay, kor),
                           first_stage_reference_model=_first_stage(shape, lay, ref),
                           **common)
    moe_ref = activations.moe_layer_activation_bytes(ref, recompute=mode, **moe)["total"]
    first = layout_stage_indices(shape.num_layers, lay)[0]
    n_moe = moe_layer_count(shape, first)
    return Activations(
        first_stage_korthikanti=_first_stage(shape, lay, kor, terms["total"]),
        first_stage_reference_model=_first_stage(shape, lay, ref, moe_ref),
        per_moe_layer_korthikanti=terms["total"], per_moe_layer_reference_model=moe_ref,
        first_stage_moe_layers=n_moe, first_stage_dense_layers=len(first) - n_moe,
        moe_layer_terms_korthikanti=terms, note=_MOE_NOTE, **common)
