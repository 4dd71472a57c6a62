"""Exact parameter counts of the reference GPT: whole model, per layer, per pipeline stage and
per tensor-parallel rank.

The reference model (``parbench/model.py``), with h = hidden, f = ffn hidden, V = vocabulary,
s = sequence length, E = experts:

==============================  ==========================  ==============================
component                       full count                  per tensor-parallel rank (t)
==============================  ==========================  ==============================
token embedding                 V h                         V h / t   (vocab-parallel)
position embedding (optional)   s h                         s h       (replicated)
LN1, LN2 (per layer)            2h + 2h                     4h        (replicated)
QKV  h -> 3h, bias              3h^2 + 3h                   (3h^2 + 3h) / t   (column)
proj h -> h, bias               h^2 + h                     h^2 / t + h       (row; bias
                                                                               replicated)
MLP  h -> f, bias; f -> h, bias 2hf + f + h                 (2hf + f) / t + h (column, row)
router h -> E, no bias (MoE)    h E                         h E       (replicated)
E expert MLPs (MoE)             E (2hf + f + h)             (E / ep)((2hf + f)/t + h)
final LN                        2h                          2h        (replicated)
LM head h -> V, no bias         V h (0 if tied)             V h / t   (vocab-parallel)
==============================  ==========================  ==============================

So a dense layer holds 4h^2 + 2hf + f + 9h parameters, which for f = 4h is 12h^2 + 13h
(Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", Sec. 5.1). The tensor-parallel split is Megatron 1D (Shoeybi et al. 2019,
Sec. 3): column-parallel linears split their weight and bias, row-parallel linears split the
weight and keep the bias whole, LayerNorms are replicated, and the embedding and LM head are
split along the vocabulary.
"""
from __future__ import annotations

from typing import Sequence

from .shape import Shape, divides, require_positive_int


# ---------------------------------------------------------------------------------------
# textbook forms (Narayanan et al. 2021, Sec. 5.1)
# ---------------------------------------------------------------------------------------

def textbook_layer_params(h: int) -> int:
    """12h^2 + 13h: one transformer layer with f = 4h (Narayanan et al. 2021, Sec. 5.1)."""
    return 12 * h * h + 13 * h


def textbook_total_params(h: int, l: int, V: int, s: int) -> int:  # noqa: E741, N803
    """P = 12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h)) (Narayanan et al. 2021, Sec. 5.1).

    Expanded: 12lh^2 + 13lh + (V + s)h -- one (tied) embedding, learned positions; the
    final LayerNorm (2h) is not in the textbook formula.
    """
    return 12 * l * h * h + 13 * l * h + (V + s) * h


# ---------------------------------------------------------------------------------------
# the reference model, exactly
# ---------------------------------------------------------------------------------------

def _check_tp(shape: Shape, tp: int) -> None:
    require_positive_int("tp", tp)
    divides("tp", tp, "num_heads", shape.num_heads)
    divides("tp", tp, "ffn_hidden_size", shape.f)
    divides("tp", tp, "vocab_size", shape.vocab_size)


def _check_ep(shape: Shape, ep: int) -> None:
    require_positive_int("ep", ep)
    if ep > 1 and not shape.moe:
        raise ValueError(f"ep={ep} needs num_experts > 0 (num_experts={shape.num_experts})")
    if shape.moe:
        divides("ep", ep, "num_experts", shape.num_experts)


def mlp_params(h: int, f: int, tp: int = 1) -> int:
    """One MLP h -> f -> h with biases: 2hf + f + h; per TP rank (2hf + f)/t + h."""
    return (2 * h * f + f) // tp + h


def layer_breakdown(shape: Shape, tp: int = 1, ep: int = 1) -> dict[str, int]:
    """Parameters of one layer on one (tp, ep) rank, by component (see the module table)."""
    _check_tp(shape, tp)
    _check_ep(shape, ep)
    h, f = shape.h, shape.f
    parts = {
        "ln1": 2 * h,
        "qkv": (3 * h * h + 3 * h) // tp,
        "proj": h * h // tp + h,
        "ln2": 2 * h,
    }
    if shape.moe:
        parts["router"] = h * shape.num_experts
        parts["experts"] = (shape.num_experts // ep) * mlp_params(h, f, tp)
    else:
        parts["mlp"] = mlp_params(h, f, tp)
    return parts


def layer_params(shape: Shape, tp: int = 1, ep: int = 1) -> int:
    """Parameters of one layer: 4h^2 + 2hf + f + 9h dense (12h^2 + 13h for f = 4h)."""
    return sum(layer_breakdown(shape, tp, ep).values())


def embedding_params(shape: Shape, tp: int = 1) -> int:
    """Token embedding V h (vocab-parallel: V h / t) plus learned positions s h (replicated)."""
    _check_tp(shape, tp)
    pos = shape.s * shape.h if shape.position_embeddings else 0
    return shape.V * shape.h // tp + pos


def head_params(shape: Shape, tp: int = 1, separate_stage: bool = False) -> int:
    """Final LN (2h) plus the LM head V h (vocab-parallel: V h / t).

    With tied embeddings the head shares the token embedding and adds nothing -- unless it
    sits on a different pipeline stage (``separate_stage``), where that stage keeps its own
    copy of the word embedding (Megatron-LM keeps the copies equal with an all-reduce of
    their gradients over the first and last stage; Narayanan et al. 2021 do not count it).
    """
    _check_tp(shape, tp)
    out = shape.V * shape.h // tp
    if shape.tie_embeddings and not separate_stage:
        out = 0
    return 2 * shape.h + out


def total_params(shape: Shape) -> int:
    """Every unique parameter of the reference model (a tied head counted once)."""
    return (embedding_params(shape) + shape.num_layers * layer_params(shape)
            + head_params(shape))


def active_params(shape: Shape) -> int:
    """Parameters a token passes through (MoE: router plus ``moe_top_k`` experts per layer).

    Equal to :func:`total_params` for a dense model.
    """
    if not shape.moe:
        return total_params(shape)
    per_layer = (layer_params(shape) - shape.num_experts * mlp_params(shape.h, shape.f)
                 + shape.moe_top_k * mlp_params(shape.h, shape.f))
    return embedding_params(shape) + shape.num_layers * per_layer + head_params(shape)


# ---------------------------------------------------------------------------------------
# pipeline stages
# ---------------------------------------------------------------------------------------

def split_layers(num_layers: int, pp: int, vpp: int = 1,
                 layers_per_stage: Sequence[int] | None = None) -> list[int]:
    """Layers held by each pipeline rank.

    Default: an even split, refusing ``num_layers`` not divisible by ``pp * vpp`` (with
    interleaving each of the ``vpp`` chunks per rank must hold the same number of layers).
    ``layers_per_stage`` gives an explicit split, which must have ``pp`` entries of at least
    one layer each, summing to ``num_layers``.
    """
    require_positive_int("pp", pp)
    require_positive_int("vpp", vpp)
    require_positive_int("num_layers", num_layers)
    if layers_per_stage is not None:
        split = list(layers_per_stage)
        if len(split) != pp:
            raise ValueError(f"layers_per_stage={split} must have pp={pp} entries")
        for n in split:
            require_positive_int("layers_per_stage entry", n)
        if sum(split) != num_layers:
            raise ValueError(f"layers_per_stage={split} sums to {sum(split)}, "
                             f"not num_layers={num_layers}")
        return split
    if num_layers % (pp * vpp):
        rule = f"pp*vpp={pp * vpp}" if vpp > 1 else f"pp={pp}"
        raise ValueError(f"{rule} does not divide num_layers={num_layers}")
    return [num_layers // pp] * pp


def stage_params(shape: Shape, pp: int = 1, tp: int = 1, ep: int = 1, vpp: int = 1,
                 layers_per_stage: Sequence[int] | None = None) -> list[dict[str, int]]:
    """Parameters on each pipeline rank (one tensor/expert-parallel rank of it).

    Stage 0 holds the embeddings, the last stage the final LN and the LM head (with
    interleaving, ``vpp`` > 1, rank 0 holds the first chunk and rank ``pp - 1`` the last, so
    the same ranks hold them). One dict per stage: ``stage``, ``layers``, ``embedding``,
    ``transformer`` (all its layers), ``head`` and ``total``.
    """
    split = split_layers(shape.num_layers, pp, vpp, layers_per_stage)
    per_layer = layer_params(shape, tp, ep)
    rows = []
    for i, n in enumerate(split):
        emb = embedding_params(shape, tp) if i == 0 else 0
        head = head_params(shape, tp, separate_stage=pp > 1) if i == pp - 1 else 0
        rows.append({"stage": i, "layers": n, "embedding": emb,
                     "transformer": n * per_layer, "head": head,
                     "total": emb + n * per_layer + head})
    return rows


def param_counts(shape: Shape, pp: int = 1, tp: int = 1, ep: int = 1, vpp: int = 1,
                 layers_per_stage: Sequence[int] | None = None) -> dict:
    """Everything above in one nested dict (the ``parameters`` block of ``estimate``)."""
    return {
        "total": total_params(shape),
        "active": active_params(shape),
        "per_layer": layer_params(shape),
        "per_layer_textbook": textbook_layer_params(shape.h) if not shape.moe
        and shape.f == 4 * shape.h else None,
        "embedding": embedding_params(shape),
        "head": head_params(shape),
        "per_rank_per_layer": layer_params(shape, tp, ep),
        "stages": stage_params(shape, pp, tp, ep, vpp, layers_per_stage),
    }
