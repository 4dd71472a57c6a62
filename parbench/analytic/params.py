"""Exact parameter counts of the reference GPT: whole model, per layer, per pipeline stage and
per tensor- / expert-parallel rank.

The reference model (``parbench/model.py``), with h = hidden, f = ffn hidden, V = vocabulary,
s = sequence length, E = experts:

==============================  ==========================  ==============================
component                       full count                  per rank (tensor-parallel t,
                                                            expert ep x etp)
==============================  ==========================  ==============================
token embedding                 V h                         V h / t   (vocab-parallel)
position embedding (optional)   s h                         s h       (replicated)
LN1, LN2 (per layer)            2h + 2h                     4h        (replicated)
QKV  h -> 3h, bias              3h^2 + 3h                   (3h^2 + 3h) / t   (column)
proj h -> h, bias               h^2 + h                     h^2 / t + h       (row; bias
                                                                               replicated)
MLP  h -> f, bias; f -> h, bias 2hf + f + h                 (2hf + f) / t + h (column, row)
router h -> E, no bias (MoE)    h E                         h E       (replicated)
E expert MLPs (MoE)             E (2hf + f + h)             (E / ep)((2hf + f)/etp + h)
final LN                        2h                          2h        (replicated)
LM head h -> V, no bias         V h (0 if tied)             V h / t   (vocab-parallel)
==============================  ==========================  ==============================

So a dense layer holds 4h^2 + 2hf + f + 9h parameters, which for f = 4h is 12h^2 + 13h
(Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", Sec. 5.1). The tensor-parallel split is Megatron 1D (Shoeybi et al. 2019,
Sec. 3): column-parallel linears split their weight and bias, row-parallel linears split the
weight and keep the bias whole, LayerNorms are replicated, and the embedding and LM head are
split along the vocabulary.

MoE layers (layer i with i % moe_every == 0, see :class:`Shape`) replace the MLP by the router
and the experts. The expert layout is Megatron-Core's (``parallel_state``: expert-tensor x
expert x expert-data parallel groups): the E experts are split over ``ep`` ranks (E / ep
each, as in GShard, Lepikhin et al. 2020, Sec. 2.2), each expert's two linears are split over
``etp`` ranks like the dense MLP over t (``etp`` 0 or ``None`` means t, Megatron-Core's
default), and the ``ep x etp`` pattern repeats over ``edp = t cp dp / (etp ep)``
expert-data-parallel ranks (:func:`expert_layout`). Every other parameter -- the router
included -- is *dense*: split over t and replicated over the dp x cp ranks. The per-rank
counts are therefore given in two parts, ``dense`` and ``expert``, each with its own
data-parallel group.

LLaMA-style shapes (analytic only; :class:`Shape` architecture fields), with d = h / a the
head size and h_kv = num_kv_heads d:

==============================  ==========================  ==============================
component                       full count                  per rank (tensor-parallel t)
==============================  ==========================  ==============================
RMSNorm (``norm="rmsnorm"``)    h (weight only)             h         (replicated)
QKV with GQA (``num_kv_heads``) h (h + 2 h_kv) [+ h + 2h_kv  (h (h + 2 h_kv) [+ ...]) / t
                                bias]                       (t | num_kv_heads or
                                                            num_kv_heads | t: no replica)
SwiGLU (``mlp="swiglu"``)       3hf [+ 2f + h bias]         3hf / t [+ 2f / t + h]
no biases (``bias=False``)      every linear's bias gone    (LayerNorm keeps its own)
==============================  ==========================  ==============================

GQA: Ainslie et al. 2023, "GQA: Training Generalized Multi-Query Transformer Models from
Multi-Head Checkpoints", Sec. 2; the K and V projections are h -> h_kv. SwiGLU: Shazeer 2020,
"GLU Variants Improve Transformer", Eq. 6 (FFN_SwiGLU = (Swish(xW) * xV) W_2: three matrices).
With t > num_kv_heads Megatron-Core still splits the fused QKV evenly, (h + 2 h_kv) / t rows
a rank, and all-gathers its output instead of replicating K/V weights (:mod:`.gqa`).
With these, LLaMA-2 (Touvron et al. 2023, "Llama 2", Table 1 and the released
``config.json``: h = 4096, l = 32, a = 32, f = 11008 for 7B; h = 8192, l = 80, a = 64,
num_kv_heads = 8, f = 28672 for 70B; V = 32000, RMSNorm, no biases, untied head, RoPE) has
6,738,415,616 and 68,976,648,192 parameters -- the "7B" and "70B" Meta publishes (the
Hugging Face model cards list 6.74B and 68.98B). Megatron-LM counts them the same way
(``megatron/training/theoretical_memory_usage.py``: attention 2h^2 (1 + g/a), MLP 2hf x 3/2
with ``--swiglu``, ``norm_size`` 1 for RMSNorm).
"""
from __future__ import annotations

from typing import Sequence

from .gqa import check_query_groups
from .expert_layout import check_ep, check_etp, expert_layout  # noqa: F401  (re-exported)
from .mla import mla_linears  # noqa: F401  (re-exported)
from .shape import Shape, divides, moe_layer_count, require_positive_int
from .stages import split_layers, stage_layer_indices  # noqa: F401  (re-exported)


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
    check_query_groups(shape, tp)  # tp | num_kv_heads, or num_kv_heads | tp
    divides("tp", tp, "ffn_hidden_size", shape.f)
    divides("tp", tp, "vocab_size", shape.vocab_size)


def mlp_params(h: int, f: int, tp: int = 1, *, gated: bool = False, bias: bool = True) -> int:
    """One MLP h -> f -> h with biases: 2hf + f + h; per TP rank (2hf + f)/t + h.

    ``gated`` (SwiGLU, Shazeer 2020 Eq. 6): gate and up h -> f (column-parallel), down
    f -> h (row-parallel): 3hf + 2f + h, per rank (3hf + 2f)/t + h. ``bias=False`` drops the
    bias terms (LLaMA: 2hf or 3hf)."""
    mats = 3 if gated else 2
    split_bias = (2 * f if gated else f) if bias else 0
    return (mats * h * f + split_bias) // tp + (h if bias else 0)


def shape_mlp_params(shape: Shape, tp: int = 1, f: int | None = None) -> int:
    """:func:`mlp_params` with the shape's ``mlp`` and ``bias`` (``f``: another hidden size
    than the dense MLP's, a routed or shared expert's)."""
    return mlp_params(shape.h, shape.f if f is None else f, tp, gated=shape.gated,
                      bias=shape.bias)


def expert_mlp_params(shape: Shape, etp: int = 1) -> int:
    """One routed expert on one expert-tensor-parallel rank (hidden size ``expert_f``)."""
    return shape_mlp_params(shape, etp, shape.expert_f)


def attention_params(shape: Shape, tp: int = 1) -> dict[str, int]:
    """QKV and output projection of one layer on one tensor-parallel rank.

    QKV (column-parallel): h (h + 2 h_kv) weights and h + 2 h_kv biases, split over t;
    projection (row-parallel): h^2 / t and a whole bias h. h_kv = h without GQA, so the
    reference model's 3h^2 + 3h and h^2 + h. Multi-head latent attention: "qkv" is every
    projection to the heads and its latents (:func:`mla_linears`)."""
    if shape.mla:
        lin = mla_linears(shape, tp)
        return {"qkv": sum(n for name, n in lin if name != "proj"),
                "proj": dict(lin)["proj"]}
    h, kv = shape.h, shape.kv_hidden
    b = int(shape.bias)
    return {"qkv": (h * (h + 2 * kv) + b * (h + 2 * kv)) // tp,
            "proj": h * h // tp + b * h}


def norm_tensor_sizes(shape: Shape) -> list[int]:
    """A norm's parameter tensors: LayerNorm's weight and bias, RMSNorm's weight."""
    return [shape.h] if shape.norm == "rmsnorm" else [shape.h, shape.h]


def dense_block_tensor_sizes(shape: Shape) -> list[int]:
    """One dense layer's parameter tensors, in the reference model's order (ln1, qkv, proj,
    ln2, fc1, fc2; each linear's weight, then its bias when ``bias``): the table above
    tensor by tensor -- qkv (h + 2 h_kv) x h, fc1 2f x h under SwiGLU ([gate; up])."""
    h, f = shape.h, shape.f

    def linear(rows: int, cols: int) -> list[int]:
        return [rows * cols] + ([rows] if shape.bias else [])
    norm = norm_tensor_sizes(shape)
    attn = [n for _, n in mla_linears(shape)] if shape.mla else \
        linear(h + 2 * shape.kv_hidden, h) + linear(h, h)
    return (norm + attn + norm + linear(2 * f if shape.gated else f, h) + linear(h, f))


#: the components of :func:`layer_breakdown` that are expert parameters (the rest is dense)
EXPERT_PARTS = ("experts",)


def layer_breakdown(shape: Shape, tp: int = 1, ep: int = 1, *, etp: int | None = None,
                    moe_layer: bool | None = None) -> dict[str, int]:
    """Parameters of one layer on one (tp, ep, etp) rank, by component (see the module table).

    ``moe_layer`` picks the kind of layer; by default an MoE layer when the model has experts
    (layer 0 is always one). On a dense layer of an MoE model the MLP is split over tp.
    """
    _check_tp(shape, tp)
    check_ep(shape, ep)
    e = check_etp(shape, tp, etp)
    moe = shape.moe if moe_layer is None else moe_layer
    if moe and not shape.moe:
        raise ValueError(f"moe_layer=True needs num_experts > 0 "
                         f"(num_experts={shape.num_experts})")
    h = shape.h
    attn = attention_params(shape, tp)
    parts = {
        "ln1": shape.norm_params,
        "qkv": attn["qkv"],
        "proj": attn["proj"],
        "ln2": shape.norm_params,
    }
    if moe:
        parts["router"] = h * shape.num_experts
        parts["experts"] = (shape.num_experts // ep) * expert_mlp_params(shape, e)
        if shape.moe_shared_expert_size:
            divides("tp", tp, "moe_shared_expert_size", shape.moe_shared_expert_size)
            parts["shared_experts"] = shape_mlp_params(shape, tp, shape.moe_shared_expert_size)
    else:
        parts["mlp"] = shape_mlp_params(shape, tp)
    return parts


def layer_params(shape: Shape, tp: int = 1, ep: int = 1, *, etp: int | None = None,
                 moe_layer: bool | None = None) -> int:
    """Parameters of one layer: 4h^2 + 2hf + f + 9h dense (12h^2 + 13h for f = 4h); an MoE
    layer trades the MLP's 2hf + f + h for h E + E (2hf + f + h). LLaMA-style (RMSNorm, GQA,
    SwiGLU, no bias): 2h^2 + 2h h_kv + 3hf + 2h."""
    return sum(layer_breakdown(shape, tp, ep, etp=etp, moe_layer=moe_layer).values())


def layer_split(shape: Shape, tp: int = 1, ep: int = 1, *, etp: int | None = None,
                moe_layer: bool | None = None) -> dict[str, int]:
    """One layer's parameters on one rank as ``{"dense": ..., "expert": ...}``."""
    parts = layer_breakdown(shape, tp, ep, etp=etp, moe_layer=moe_layer)
    expert = sum(v for k, v in parts.items() if k in EXPERT_PARTS)
    return {"dense": sum(parts.values()) - expert, "expert": expert}


def embedding_params(shape: Shape, tp: int = 1) -> int:
    """Token embedding V h (vocab-parallel: V h / t) plus learned positions s h (replicated)."""
    _check_tp(shape, tp)
    pos = shape.s * shape.h if shape.position_embeddings else 0
    return shape.V * shape.h // tp + pos


def head_params(shape: Shape, tp: int = 1, separate_stage: bool = False) -> int:
    """Final norm (2h, or h for RMSNorm) plus the LM head V h (vocab-parallel: V h / t).

    With tied embeddings the head shares the token embedding and adds nothing -- unless it
    sits on a different pipeline stage (``separate_stage``), where that stage keeps its own
    copy of the word embedding (Megatron-LM keeps the copies equal with an all-reduce of
    their gradients over the first and last stage; Narayanan et al. 2021 do not count it).
    """
    _check_tp(shape, tp)
    out = shape.V * shape.h // tp
    if shape.tie_embeddings and not separate_stage:
        out = 0
    return shape.norm_params + out


def _layers_total(shape: Shape, moe_layers: int, dense_layers: int, tp: int = 1, ep: int = 1,
                  etp: int | None = None) -> dict[str, int]:
    out = {"dense": 0, "expert": 0}
    for n, moe in ((moe_layers, True), (dense_layers, False)):
        if n:
            for k, v in layer_split(shape, tp, ep, etp=etp, moe_layer=moe).items():
                out[k] += n * v
    return out


def mtp_layer_is_moe(shape: Shape) -> bool:
    """A multi-token prediction module's layer is an MoE layer when the model's last layer
    is (Megatron-LM ``training.py``, ``num_floating_point_operations``: last_layer_is_moe)."""
    return shape.is_moe_layer(shape.num_layers - 1)


def mtp_split(shape: Shape, tp: int = 1, ep: int = 1, *, etp: int | None = None
              ) -> dict[str, int]:
    """One multi-token prediction module on one rank, as ``{"dense", "expert"}`` (DeepSeek-V3,
    arXiv 2412.19437, Sec. 2.2, Eq. 21-22; Megatron-Core's ``MultiTokenPredictionLayer``):
    the norms of the embedding and of the previous depth's hidden state and a final norm
    (three norms), the projection M_k of the concatenated [h; emb] (2h -> h, no bias, a
    column-parallel linear: 2h^2 / t), one transformer layer of the last layer's kind
    (:func:`mtp_layer_is_moe`). The embedding and the output head are the main model's
    (shared, not counted again)."""
    split = layer_split(shape, tp, ep, etp=etp, moe_layer=mtp_layer_is_moe(shape))
    split["dense"] += 3 * shape.norm_params + 2 * shape.h * shape.h // tp
    return split


def mtp_params(shape: Shape, tp: int = 1, ep: int = 1, *, etp: int | None = None) -> int:
    """Every multi-token prediction module (``mtp_layers`` of :func:`mtp_split`)."""
    return shape.mtp_layers * sum(mtp_split(shape, tp, ep, etp=etp).values())


def total_params(shape: Shape) -> int:
    """Every unique parameter of the reference model (a tied head counted once), the
    multi-token prediction modules included (:func:`mtp_params`)."""
    n_moe = shape.num_moe_layers
    layers = _layers_total(shape, n_moe, shape.num_layers - n_moe)
    return embedding_params(shape) + layers["dense"] + layers["expert"] + head_params(shape) \
        + mtp_params(shape)


def active_params(shape: Shape) -> int:
    """Parameters a token passes through: on each MoE layer the router and ``moe_top_k`` of
    the E experts (Fedus et al. 2021, Switch Transformer, Sec. 2: top-1 routing keeps the
    FLOPs per token of the dense model), an MoE layer of a multi-token prediction module
    likewise. Equal to :func:`total_params` for a dense model."""
    mlp = expert_mlp_params(shape)
    moe_layers = shape.num_moe_layers + (shape.mtp_layers if mtp_layer_is_moe(shape) else 0)
    return total_params(shape) - moe_layers * (shape.num_experts - shape.moe_top_k) * mlp


def largest_module_params(shape: Shape, tp: int = 1, ep: int = 1, *,
                          etp: int | None = None) -> int:
    """Parameters of the largest single module on one (tp, ep, etp) rank: DeepSpeed's
    ``largest_layer_params`` (``deepspeed/runtime/zero/stage3.py``, ``model_to_params``:
    the maximum over modules of their own parameters, ``recurse=False``), at the per-rank
    size of each module. Candidates: the token embedding and the untied LM head (V h / t),
    the position embedding (s h), QKV, the projection, each MLP linear (fc1 h -> f, or h -> 2f
    for SwiGLU's fused gate and up, and fc2, with their biases), on MoE layers one expert's
    linears split over etp and the router (h E)."""
    _check_tp(shape, tp)
    check_ep(shape, ep)
    e = check_etp(shape, tp, etp)
    h, b, g = shape.h, int(shape.bias), 2 if shape.gated else 1
    attn = attention_params(shape, tp)
    cands = [shape.V * h // tp, attn["proj"]] + \
        ([n for _, n in mla_linears(shape, tp)] if shape.mla else [attn["qkv"]])
    if shape.position_embeddings:
        cands.append(shape.s * h)
    mlps = ((tp, shape.f, shape.num_moe_layers < shape.num_layers),
            (e, shape.expert_f, shape.moe),
            (tp, shape.moe_shared_expert_size, shape.moe and shape.moe_shared_expert_size))
    for t, f, present in mlps:
        if present:
            cands += [(h * g * f + b * g * f) // t, h * f // t + b * h]
    if shape.moe:
        cands.append(h * shape.num_experts)
    return max(cands)


# ---------------------------------------------------------------------------------------
# pipeline stages
# ---------------------------------------------------------------------------------------

def stage_params(shape: Shape, pp: int = 1, tp: int = 1, ep: int = 1, vpp: int = 1,
                 layers_per_stage: Sequence[int] | None = None, *,
                 etp: int | None = None, first: int = 0, last: int = 0
                 ) -> list[dict[str, int]]:
    """Parameters on each pipeline rank (one tensor/expert-parallel rank of it).

    Stage 0 holds the embeddings, the last stage the final LN and the LM head (with
    interleaving, ``vpp`` > 1, rank 0 holds the first chunk and rank ``pp - 1`` the last, so
    the same ranks hold them). One dict per stage: ``stage``, ``layers``, ``embedding``,
    ``transformer`` (all its layers; on the last rank the multi-token prediction modules
    too, as Megatron-Core places them), ``head`` and ``total``; for an MoE model also
    ``moe_layers`` (how many of its layers are MoE layers), ``expert`` (its expert
    parameters, replicated over edp) and ``dense`` (the rest, replicated over dp x cp).
    ``first`` / ``last``: an uneven first / last rank (``layout.pipeline_chunks``).
    """
    per_rank = stage_layer_indices(shape.num_layers, pp, vpp, layers_per_stage, first=first,
                                   last=last)
    rows = []
    for i, idx in enumerate(per_rank):
        n, n_moe = len(idx), moe_layer_count(shape, idx)
        layers = _layers_total(shape, n_moe, n - n_moe, tp, ep, etp)
        emb = embedding_params(shape, tp) if i == 0 else 0
        head = head_params(shape, tp, separate_stage=pp > 1) if i == pp - 1 else 0
        if i == pp - 1 and shape.mtp_layers:  # Megatron-Core: MTP on the last stage
            for k, v in mtp_split(shape, tp, ep, etp=etp).items():
                layers[k] += shape.mtp_layers * v
        trans = layers["dense"] + layers["expert"]
        row = {"stage": i, "layers": n, "embedding": emb, "transformer": trans, "head": head,
               "total": emb + trans + head}
        if shape.moe:
            row.update({"moe_layers": n_moe, "dense": row["total"] - layers["expert"],
                        "expert": layers["expert"]})
        rows.append(row)
    return rows


def param_counts(shape: Shape, pp: int = 1, tp: int = 1, ep: int = 1, vpp: int = 1,
                 layers_per_stage: Sequence[int] | None = None, *,
                 etp: int | None = None, first: int = 0, last: int = 0) -> dict:
    """Everything above in one nested dict (the ``parameters`` block of ``estimate``).

    For an MoE model ``per_layer`` and ``per_rank_per_layer`` are an MoE layer's (layer 0);
    ``by_layer_kind`` gives both kinds, whole and per rank split into dense and expert parts.
    """
    out = {
        "total": total_params(shape),
        "active": active_params(shape),
        "per_layer": layer_params(shape),
        "per_layer_textbook": textbook_layer_params(shape.h) if not shape.moe
        and shape.f == 4 * shape.h and shape.gpt_style else None,
        "embedding": embedding_params(shape),
        "head": head_params(shape),
        "per_rank_per_layer": layer_params(shape, tp, ep, etp=etp),
        "stages": stage_params(shape, pp, tp, ep, vpp, layers_per_stage, etp=etp,
                               first=first, last=last),
    }
    if shape.mtp_layers:  # the multi-token prediction modules' share of ``total``
        out["mtp"] = mtp_params(shape)
    if shape.moe:
        out["moe_layers"] = shape.num_moe_layers
        out["moe_every"] = shape.moe_every
        out["by_layer_kind"] = {
            kind: {"layers": n, "per_layer": layer_params(shape, moe_layer=moe),
                   "per_rank": layer_split(shape, tp, ep, etp=etp, moe_layer=moe)}
            for kind, moe, n in (("moe", True, shape.num_moe_layers),
                                 ("dense", False, shape.num_layers - shape.num_moe_layers))}
    return out
