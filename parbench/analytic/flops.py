"""Floating-point operations per iteration and model FLOPs utilisation.

Counting convention (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on
GPU Clusters Using Megatron-LM", Appendix): only matrix multiplications, one
multiply-accumulate = 2 FLOPs; an (m x k) @ (k x n) product costs 2mkn. For one transformer
layer with f = 4h on B sequences of s tokens the forward pass costs

    QKV 6Bsh^2 + attention scores 2Bs^2h + attention over values 2Bs^2h
    + output projection 2Bsh^2 + MLP 16Bsh^2  =  24Bsh^2 + 4Bs^2h,

and the logit layer 2BshV. The backward pass costs twice the forward; full activation
recomputation adds one more forward of the transformer layers (not of the logit layer, which
is never recomputed). That gives Eq. 3 of the paper:

    F = 4 l (24Bsh^2 + 4Bs^2h) + 3 (2BshV) = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)).

Note that the logit term is 6BshV = 3 x 2BshV, not 4 x 2BshV: multiplying the whole forward
count l(24Bsh^2 + 4Bs^2h) + 2BshV by 4 overcounts Eq. 3 by exactly 2BshV.
The attention terms count the full s x s score matrix (no causal halving), as the paper does.

:func:`shape_forward_flops` states the causal choice as an option: ``causal="full"`` (the
default, today's behaviour: the paper's 4Bs^2h per layer, which PaLM's model FLOPs,
Chowdhery et al. 2022, App. B, 12 L H Q T per token for training, also count) or
``"half"``: a causal mask leaves s(s+1)/2 of the s^2 scores to compute, counted as half,
2Bs^2h (as FlashAttention-2's benchmarks count causal attention, Dao 2023, Sec. 4.1). Only
the score (QK^T) and value (AV) products are halved; the projections are unaffected.

LLaMA-style shapes (see :mod:`.params`): QKV costs 2Bsh(h + 2 h_kv) with grouped-query
attention (h_kv = num_kv_heads x head size; the K and V projections shrink, the scores do
not: every query head still attends), and a SwiGLU MLP 6Bshf (three matrices) instead of
4Bshf. RMSNorm, biases and the nonlinearities are not matrix multiplications and are not
counted, as before.
"""
from __future__ import annotations

from fractions import Fraction

from .params import mla_linears, mtp_layer_is_moe
from .shape import Shape, require_positive


def transformer_forward_flops(b: int, s: int, h: int, l: int) -> int:  # noqa: E741
    """l (24bsh^2 + 4bs^2h): forward FLOPs of l layers with f = 4h (Narayanan 2021, App.)."""
    return l * (24 * b * s * h * h + 4 * b * s * s * h)


def logit_forward_flops(b: int, s: int, h: int, V: int) -> int:  # noqa: N803
    """2bshV: forward FLOPs of the LM head (Narayanan 2021, Appendix)."""
    return 2 * b * s * h * V


def forward_flops(b: int, s: int, h: int, l: int, V: int) -> int:  # noqa: E741, N803
    """l (24bsh^2 + 4bs^2h) + 2bshV: one forward pass over b sequences."""
    return transformer_forward_flops(b, s, h, l) + logit_forward_flops(b, s, h, V)


def training_flops(b: int, s: int, h: int, l: int, V: int,  # noqa: E741, N803
                   recompute: bool = False) -> int:
    """FLOPs of one training iteration: 3x the forward (backward = 2x forward), or for the
    transformer layers 4x with full activation recomputation; the logit layer is 3x always.

    With ``recompute=True`` this equals :func:`megatron_eq3_flops` exactly.
    """
    layer_mult = 4 if recompute else 3
    return layer_mult * transformer_forward_flops(b, s, h, l) + 3 * logit_forward_flops(b, s, h, V)


def megatron_eq3_flops(B: int, s: int, l: int, h: int, V: int) -> int:  # noqa: E741, N803
    """96 B s l h^2 (1 + s/(6h) + V/(16 l h)) (Narayanan et al. 2021, Eq. 3), evaluated
    exactly as printed (with rational arithmetic). Counts full recomputation."""
    value = Fraction(96 * B * s * l * h * h) * (1 + Fraction(s, 6 * h)
                                                + Fraction(V, 16 * l * h))
    return int(value)  # whole: 96Bslh^2 + 16Bs^2lh + 6BshV


CAUSAL = ("full", "half")


def attention_score_flops(b: int, s: int, h: int, causal: str = "full") -> int:
    """QK^T and AV of one layer on b sequences: 4bs^2h, or 2bs^2h with ``causal="half"``."""
    if causal not in CAUSAL:
        raise ValueError(f"causal_flops={causal!r} must be one of {', '.join(CAUSAL)}")
    return (4 if causal == "full" else 2) * b * s * s * h


def shape_forward_flops(shape: Shape, b: int, s: int | None = None,
                        causal: str = "full") -> int:
    """Forward FLOPs for any :class:`Shape` (any f, MoE, GQA, SwiGLU), same counting convention.

    Per token and layer: QKV 2h(h + 2h_kv) + projection 2h^2 (8h^2 without GQA; under
    multi-head latent attention twice its projections' weights), and the MLP:
    4hf (6hf for SwiGLU) on a dense layer; on an MoE layer (``Shape.is_moe_layer``: every
    ``moe_every``-th layer) that per active expert (``moe_top_k`` of them, each of hidden size
    ``expert_f``) and for the shared experts (``moe_shared_expert_size``) plus the router
    2hE. Per sequence and layer: attention 4s^2h (2s^2h with ``causal="half"``, see the
    module doc; 2s^2 (w_q + w_o) with MLA's query/key and value widths); logit layer 2shV.
    For a dense GPT shape with f = 4h and ``causal="full"`` this is :func:`forward_flops`.
    Each multi-token prediction module (``mtp_layers``; DeepSeek-V3 Sec. 2.2) adds its layer
    (:func:`.params.mtp_layer_is_moe`), its projection 2 (2h) h and its logits 2hV per token,
    as Megatron-LM's ``num_floating_point_operations`` (which also counts the norms; they
    are not matrix multiplications and not counted here, as above).
    """
    s = shape.s if s is None else s
    h, n_moe, mtp = shape.h, shape.num_moe_layers, shape.mtp_layers
    per_token = (shape.num_layers - n_moe) * layer_token_flops(shape, False) \
        + n_moe * layer_token_flops(shape, True)
    if mtp:  # each module's layer, its 2h -> h projection and its logits
        per_token += mtp * (layer_token_flops(shape, mtp_layer_is_moe(shape)) + 4 * h * h
                            + 2 * h * shape.V)
    q_w, _, _, o_w = shape.attention_widths()
    # QK^T over every query head's width, AV over every head's value width (K/V heads shared
    # under GQA still meet each query head): 2 b s^2 (w_q + w_o), attention_score_flops at h
    # when both are h
    scores = attention_score_flops(b, s, q_w + o_w, causal) // 2
    return b * s * per_token + (shape.num_layers + mtp) * scores + 2 * b * s * h * shape.V


def layer_token_flops(shape: Shape, moe: bool) -> int:
    """One layer's forward FLOPs per token outside the attention scores (see
    :func:`shape_forward_flops`): a dense layer's, or an MoE layer's when ``moe``."""
    h = shape.h
    if shape.mla:  # every projection's weights, twice (the latents' norms are not matmuls)
        attn = 2 * sum(n for name, n in mla_linears(shape) if not name.endswith("norm"))
    else:
        attn = 2 * h * (h + 2 * shape.kv_hidden) + 2 * h * h
    per_f = (6 if shape.gated else 4) * h  # an MLP's FLOPs per token and unit of width
    if not moe:
        return attn + per_f * shape.f
    return attn + per_f * (shape.expert_f * shape.moe_top_k + shape.moe_shared_expert_size) \
        + 2 * h * shape.num_experts


def shape_training_flops(shape: Shape, b: int, s: int | None = None,
                         recompute: bool = False, causal: str = "full") -> int:
    """:func:`training_flops` for any :class:`Shape` (logit layer 3x, layers 3x or 4x)."""
    s = shape.s if s is None else s
    logit = 2 * b * s * shape.h * shape.V * (1 + shape.mtp_layers)
    layers = shape_forward_flops(shape, b, s, causal) - logit
    return (4 if recompute else 3) * layers + 3 * logit


def params_rule_flops(params: float, tokens: float, recompute: bool = False) -> float:
    """6 FLOPs per parameter per token for training, 8 with full recomputation.

    The rule follows from the layer count above when s << 6h: 3 x 24Bsh^2 l = 6 (12 l h^2)(Bs)
    and 3 x 2BshV = 6 (Vh)(Bs) (Kaplan et al. 2020, Sec. 2.1; Narayanan et al. 2021, App.).
    """
    return (8 if recompute else 6) * params * tokens


def training_time_estimate(tokens: float, params: float, num_devices: int,
                           flops_per_device: float, recompute: bool = True) -> float:
    """End-to-end training time ~ 8TP/(nX) seconds (Narayanan et al. 2021, Sec. 5.1):
    T tokens, P parameters, n devices at X achieved FLOP/s each (6TP/(nX) without
    recomputation)."""
    require_positive("flops_per_device", flops_per_device)
    return params_rule_flops(params, tokens, recompute) / (num_devices * flops_per_device)


def achieved_flops(flops_per_iteration: float, iteration_time_s: float,
                   num_devices: int = 1) -> float:
    """Achieved FLOP/s per device."""
    require_positive("iteration_time_s", iteration_time_s)
    return flops_per_iteration / iteration_time_s / num_devices


def mfu(flops_per_iteration: float, iteration_time_s: float, peak_flops_per_device: float,
        num_devices: int = 1) -> float:
    """Model FLOPs utilisation: achieved FLOP/s per device over the device's peak.

    Pass model FLOPs without recomputation (``training_flops(..., recompute=False)``) for MFU
    as defined by Chowdhery et al. 2022 (PaLM, App. B); with recomputation counted it is the
    hardware FLOPs utilisation that Narayanan et al. 2021 report.
    """
    require_positive("peak_flops_per_device", peak_flops_per_device)
    achieved = achieved_flops(flops_per_iteration, iteration_time_s, num_devices)
    return achieved / peak_flops_per_device
