"""The five-axis hybrid's step on one rank, in closed form: every transfer per axis and the
model states, for any degrees tp x cp x dp x pp (ep re-partitioning the tp x cp x dp ranks of a
stage with expert-tp 1).

Per axis, from the papers (the formulas live in :mod:`.comm`, :mod:`.tensor`, :mod:`.context`):

- **tp** (Shoeybi et al. 2019 Sec. 3; Korthikanti et al. 2022 Sec. 4.2.2): per layer per
  micro-batch on the rank's b x s/cp tokens, 4 all-reduces (6 with full recomputation), or
  with sequence parallelism the all-gather / reduce-scatter pairs of
  :func:`.tensor.megatron_layer_traffic`. An MoE layer's MLP keeps the dense MLP's ``f`` and
  ``g`` (its tokens are split over tp and recombined by ``g``); under sequence parallelism
  its tokens already are the rank's shard, so an MoE layer has only the attention half.
  The first stage reduces the embedding's partial lookups, the last stage all-reduces the
  LM head's input gradient and 3 per-token values of the vocab-parallel loss. Once per step
  the gradients that are partial over tp (routers; under SP every tp-replicated parameter)
  are all-reduced in one buffer.
- **cp** (:func:`.context.attention_traffic` at the rank's h/t width, K/V at its
  g/t heads' width under GQA): all-gather, ring attention or Ulysses; recomputation repeats
  the core's forward traffic. With tp > num_kv_heads the QKV output's gather and
  reduce-scatter per layer (:func:`.gqa.qkv_gather_transfers`, Megatron-Core's GQA split).
- **ep** (GShard Sec. 2.2 / Switch Sec. 2): per MoE layer per micro-batch 2 all-to-alls
  forward and 2 backward (2 more forward with full recomputation) of the padded dispatch
  buffer E x C x h, C = ceil(capacity_factor k T / E) for the T = b s/(cp t) tokens a rank
  routes.
- **pp** (Narayanan et al. 2021 Sec. 4.1): a send of the boundary activation (b s/cp h, /t
  under SP) per micro-batch per stage boundary each way, unless both stages are on the rank
  (the turn of the V placement of ZB-V and DualPipeV, Qi et al. 2024b). Schedules with a
  split backward (B, W) move the same bytes as the fused ones. A bidirectional schedule
  (Chimera, DualPipe) holds two stage copies per rank, sends m/2 micro-batches down each
  pipe and once per step swaps the copies' gradients with the partner rank p-1-r.
- **dp_cp / edp**: the dense gradients all-reduced once per step over the dp x cp ranks
  (Megatron-Core's ``dp_cp`` group), the experts' over the expert-data-parallel group
  edp = t cp d / ep; with ZeRO 1-3 each becomes a reduce-scatter of the padded flat buffer
  and an all-gather of the parameters (Rajbhandari et al. 2020, Sec. 5; 2 Psi per rank either
  way; ZeRO-3 as torchtitan runs FSDP under a pipeline, gathered once per step). Bytes per
  element e: 4 (fp32) or 2 (bf16 activations, parameters and gradients; the vocab-parallel
  loss's per-token values stay fp32).
- **DeepSeek-V3's MoE** (arXiv 2412.19437, Sec. 2.1.2): routed experts of hidden size
  ``moe_ffn_hidden_size`` (fine-grained); the shared expert whole on every tp rank, a dense
  parameter (``dp_cp``) whose gradient, like the router's, is partial over tp; the first
  ``moe_first_dense`` layers dense. With the balancing bias (``moe_bias_update_rate`` > 0),
  once per step one all-reduce of the rank's ``[L_moe, E]`` float32 loads over its stage's
  t cp d ranks (axis ``tp_dp_cp``, :func:`bias_transfers`), and E float32 biases per MoE
  layer as model state "other".
- **embd** (``tie_embeddings`` with more than one stage; Narayanan et al. 2021, Megatron-LM's
  ``_allreduce_word_embedding_grads``): the first stage's embedding and the last stage's copy
  of it as the output layer add their gradients once per step, one all-reduce of the tp
  rank's V'/t x h rows over the embedding group (the n = 2 ranks of a pipeline that hold
  exactly one of the copies, :func:`tied_transfers`); a rank holding both adds them locally.
  The copy is a parameter of the last stage (:func:`stage_params`): its gradient, its AdamW
  moments and its step counter are model states like the embedding's.
- **clipping** by global norm (``clip_grad`` > 0; Pascanu et al. 2013; Megatron-LM's
  ``clip_grad_norm_fp32``): the squared norm, 4 bytes, all-reduced once on every axis the
  reduced gradient is spread over (:func:`clip_spread`): tp (shards; duplicates counted on
  one rank), dp_cp and edp with ZeRO 1-3 (the rank's shard of the flat buffer), ep for an
  MoE model (experts sharded), pp (stages).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..layout import Layout
from ..options import Options
from .clip import norm_transfers
from .comm import Transfer
from .context import attention_traffic
from .pipeline import num_stages, stages_on_rank, tied_embedding_holder
from .shape import Shape, expert_capacity
from .gqa import local_kv_heads, qkv_gather_transfers
from .mla import MLA_REPLICATED, mla_linears, mla_tp_input_width
from .params import attention_params, norm_tensor_sizes, shape_mlp_params
from .expert import mlp_tensor_sizes
from .tensor import (megatron_layer_traffic, mla_layer_traffic,  # noqa: F401
                     mla_sp_layer_traffic, padded_vocab, per_axis)


@dataclass(frozen=True)
class HybridStep:
    """What the closed form reads: the case's layout and options, the schedule's placement
    and stages per rank per replica (its spec's facts), and bytes per element (4 fp32, 2
    bf16)."""

    layout: Layout
    options: Options = field(default_factory=Options)
    placement: str = "linear"
    chunks: int = 1
    e: int = 4
    #: gradient clipping by global norm (0: off): its norm's all-reduces
    clip_grad: float = 0.0

    @property
    def sp(self) -> bool:
        """Sequence parallelism in effect (it needs tp > 1)."""
        return self.options.tensor.sp and self.layout.tp > 1


@dataclass(frozen=True)
class StageParams:
    """One rank's parameters of one stage, by gradient group (elements and tensors)."""

    dense: int
    dense_tensors: int
    expert: int
    expert_tensors: int
    tp_partial: int  # dense elements whose gradient is partial over tp


def stage_params(shape: Shape, c: HybridStep, lo: int, hi: int, first: bool,
                 last: bool) -> StageParams:
    """Elements a rank holds of stage [lo, hi): tp shards of the dense part (Megatron's
    placements, vocabulary padded to a multiple of t; QKV with its query groups' K/V heads
    and fc1 with SwiGLU's gate and up rows: ``params.attention_params`` /
    ``shape_mlp_params``; the norms LayerNorm or RMSNorm, biases only with ``bias``), E/ep
    whole experts per MoE layer."""
    h, t = shape.h, c.layout.tp
    dense = tensors = partial = replicated = 0

    def add(n, k=1, *, repl=False):  # n elements in k tensors
        nonlocal dense, tensors, replicated
        dense, tensors = dense + n, tensors + k
        replicated += n if repl else 0
    norm, bias = shape.norm_params, int(shape.bias)
    norm_tensors = len(norm_tensor_sizes(shape))
    if first:
        add(padded_vocab(shape.V, t) // t * h)
        if shape.position_embeddings:
            add(shape.s * h, repl=True)
    expert = expert_tensors = 0
    attn = attention_params(shape, t)  # column-parallel QKV, row-parallel projection
    for i in range(lo, hi):
        add(2 * norm, 2 * norm_tensors, repl=True)  # ln1, ln2
        if shape.mla:
            _add_mla(shape, t, add)
        else:
            add(attn["qkv"], 1 + bias)
        add(attn["proj"] - bias * h, 1)
        add(bias * h, bias, repl=True)  # projection bias, whole
        if shape.is_moe_layer(i):
            shared = _shared_expert(shape)
            add(shape.num_experts * h + shared[0], 1 + shared[1])
            partial += shape.num_experts * h + shared[0]  # router, shared expert: whole
            per = shape.num_experts // c.layout.ep
            sizes = mlp_tensor_sizes(h, shape.expert_f, shape.gated, shape.bias)
            expert += per * sum(sizes)
            expert_tensors += len(sizes) * per
        else:
            add(shape_mlp_params(shape, t) - bias * h, 2 + bias)  # fc1 (+ bias), fc2
            add(bias * h, bias, repl=True)  # fc2 bias, whole
    if last:
        add(norm, norm_tensors, repl=True)
        if not shape.tie_embeddings or not first:  # tied: the last stage's own copy
            add(padded_vocab(shape.V, t) // t * h)
    if t == 1:
        partial = 0
    elif c.sp:
        partial += replicated
    return StageParams(dense, tensors, expert, expert_tensors, partial)


def _add_mla(shape: Shape, t: int, add) -> None:
    """One MLA layer's tensors but the output projection (``mla.mla_linears``: the down
    projections and the latents' norms whole on every tp rank, the up projections split
    over t -- Megatron-Core's MLASelfAttention, as ``impls.tensor.megatron_mla`` places them):
    each its own tensor, the whole ones replicated over tp."""
    for name, n in mla_linears(shape, t):
        if name != "proj":
            add(n, 1, repl=name in MLA_REPLICATED)


def _shared_expert(shape: Shape) -> tuple[int, int]:
    """(elements, tensors) of an MoE layer's shared expert, an MLP of hidden size
    ``moe_shared_expert_size`` (DeepSeek-V3 Eq. 12; the experts' kind: GELU with biases, or
    SwiGLU without, ``expert.mlp_tensor_sizes``), whole on every tp rank; (0, 0) without
    one."""
    fs = shape.moe_shared_expert_size
    sizes = mlp_tensor_sizes(shape.h, fs, shape.gated, shape.bias) if fs else []
    return sum(sizes), len(sizes)


def _stages(shape: Shape, c: HybridStep, pp_rank: int):
    lay = c.layout
    S = num_stages(c.placement, lay.pp, c.chunks)  # noqa: N806
    per = shape.l // S
    for pipe, st in stages_on_rank(c.placement, lay.pp, pp_rank, c.chunks):
        yield pipe, st, st * per, (st + 1) * per, st == 0, st == S - 1, S


def microbatches_per_pipe(c: HybridStep) -> int:
    """A bidirectional schedule sends half the m micro-batches down each pipe (Chimera,
    Li and Hoefler 2021 Sec. 3.1; DualPipe)."""
    lay = c.layout
    return lay.num_microbatches // 2 if c.placement == "bidirectional" else lay.num_microbatches


def stage_transfers(shape: Shape, c: HybridStep, lo: int, hi: int, first: bool,
                    last: bool) -> list[Transfer]:
    """The tp, cp and ep transfers of one stage (copy) in one step (the micro-batches of its
    pipe)."""
    lay, rc = c.layout, c.options.recompute
    t, m, b, e = lay.tp, microbatches_per_pipe(c), lay.micro_batch_size, c.e
    s_l = shape.s // lay.cp
    S = b * s_l * shape.h * e  # noqa: N806
    moe = sum(shape.is_moe_layer(i) for i in range(lo, hi))
    dense = hi - lo - moe
    out: list[Transfer] = []
    if t > 1:
        out += qkv_gather_transfers(shape, b, s_l, t, rc, e, (hi - lo) * m)  # t > g (GQA)
        layers = _mla_tp_layers if shape.mla else _mha_tp_layers
        out += layers(shape, c, s_l, dense * m, moe * m)
        if first:
            out += ([Transfer("tp", "reduce_scatter", t, S, m, "embedding (fwd)"),
                     Transfer("tp", "all_gather", t, S, m, "embedding grad (bwd)")] if c.sp
                    else [Transfer("tp", "all_reduce", t, S, m, "embedding (fwd)")])
        if last:
            out += ([Transfer("tp", "all_gather", t, S, 2 * m, "LM head input (fwd, bwd)"),
                     Transfer("tp", "reduce_scatter", t, S, m, "LM head input grad")]
                    if c.sp else [Transfer("tp", "all_reduce", t, S, m, "LM head input grad")])
            out.append(Transfer("tp", "all_reduce", t, b * s_l * 4, 3 * m,
                                "vocab-parallel cross-entropy"))
    if lay.cp > 1:
        out += attention_traffic(c.options.context.cp_algorithm, b, shape.s, shape.h // t,
                                 lay.cp, 1, hi - lo, m, e, rc != "none",
                                 h_kv=local_kv_heads(shape, t) * shape.head_dim)
    if lay.ep > 1 and moe:
        tokens = b * s_l // t
        cap = expert_capacity(tokens, shape.num_experts, shape.moe_top_k,
                              shape.moe_capacity_factor) or tokens
        n = (6 if rc == "full" else 4) * moe * m
        out.append(Transfer("ep", "all_to_all", lay.ep, shape.num_experts * cap * shape.h * e,
                            n, "MoE dispatch and combine"))
    return out


def _mha_tp_layers(shape: Shape, c: HybridStep, s_l: int, dense: int,
                   moe: int) -> list[Transfer]:
    """The layers' tp transfers (``dense`` and ``moe`` layer micro-batches): Megatron's
    (``tensor.megatron_layer_traffic``); under sp an MoE layer keeps its attention's only
    (the MoE routes the rank's sequence shard), without sp the dense MLP's f and g too."""
    lay, rc, e = c.layout, c.options.recompute, c.e
    t, b = lay.tp, lay.micro_batch_size
    out = megatron_layer_traffic(b, s_l, shape.h, t, rc, c.sp, e, dense)
    if not c.sp:
        return out + megatron_layer_traffic(b, s_l, shape.h, t, rc, False, e, moe)
    S, k = b * s_l * shape.h * e, 2 if rc == "full" else 1  # noqa: N806
    return out + [Transfer("tp", "all_gather", t, S, (k + 2) * moe, "MoE layers: QKV"),
                  Transfer("tp", "reduce_scatter", t, S, (k + 1) * moe,
                           "MoE layers: attention projection")]


def _mla_tp_layers(shape: Shape, c: HybridStep, s_l: int, dense: int,
                   moe: int) -> list[Transfer]:
    """The same for multi-head latent attention (cp = 1, s_l = s): ``tensor.
    mla_layer_traffic`` / ``mla_sp_layer_traffic``; under sp an MoE layer's attention part
    only: the latents, query input and rotary key (w = ``mla.mla_tp_input_width`` per token)
    all-gathered forward (again under full recomputation) and reduce-scattered backward,
    the projection's output reduce-scattered forward (again) and all-gathered backward."""
    lay, full, e = c.layout, c.options.recompute == "full", c.e
    t, b = lay.tp, lay.micro_batch_size
    if not c.sp:
        return mla_layer_traffic(shape, b, t, dense + moe, e, full)
    out = mla_sp_layer_traffic(shape, b, t, dense, e, full) if dense else []
    if not moe:
        return out
    S, W = b * s_l * shape.h * e, b * s_l * mla_tp_input_width(shape) * e  # noqa: N806
    return out + [
        Transfer("tp", "all_gather", t, W, (1 + full) * moe, "MoE layers: MLA latents"),
        Transfer("tp", "reduce_scatter", t, W, moe, "MoE layers: MLA latents' grad"),
        Transfer("tp", "reduce_scatter", t, S, (1 + full) * moe, "MoE layers: projection"),
        Transfer("tp", "all_gather", t, S, moe, "MoE layers: projection grad")]


def _grad_sync(axis: str, n: int, numel: int, c: HybridStep, what: str) -> list[Transfer]:
    if n < 2 or not numel:
        return []
    if c.options.data.zero_stage == 0:
        return [Transfer(axis, "all_reduce", n, numel * c.e, 1, what)]
    padded = -(-numel // n) * n
    return [Transfer(axis, "reduce_scatter", n, padded * c.e, 1, what),
            Transfer(axis, "all_gather", n, padded * c.e, 1, what + ": updated parameters")]


def rank_step(shape: Shape, c: HybridStep, rank: int) -> tuple[list[Transfer], dict]:
    """(transfers, model states) of global rank ``rank`` in one step."""
    lay = c.layout
    t, cp, dp = lay.tp, lay.cp, lay.dp
    pp_rank = rank // (t * cp * dp)
    out: list[Transfer] = []
    dense = dense_tensors = expert = expert_tensors = partial = moe = 0
    mine = {(pipe, st) for pipe, st, *_ in _stages(shape, c, pp_rank)}
    m = microbatches_per_pipe(c)
    for pipe, st, lo, hi, first, last, S in _stages(shape, c, pp_rank):  # noqa: N806
        out += stage_transfers(shape, c, lo, hi, first, last)
        p = stage_params(shape, c, lo, hi, first, last)
        dense += p.dense
        dense_tensors += p.dense_tensors
        expert += p.expert
        expert_tensors += p.expert_tensors
        partial += p.tp_partial
        moe += sum(shape.is_moe_layer(i) for i in range(lo, hi))
        act = lay.micro_batch_size * (shape.s // cp) // (t if c.sp else 1) * shape.h * c.e
        # a boundary between two stages of this rank (the V placement's turn) stays local
        if st < S - 1 and (pipe, st + 1) not in mine:
            out.append(Transfer("pp", "send", 2, act, m, "activations"))
        if st > 0 and (pipe, st - 1) not in mine:
            out.append(Transfer("pp", "send", 2, act, m, "activation grads"))
    if c.placement == "bidirectional":
        out.append(Transfer("pp", "send", 2, (dense + expert) * c.e, 1,
                            "gradients of both stage copies to the partner rank"))
    if partial and t > 1:
        out.append(Transfer("tp", "all_reduce", t, partial * c.e, 1,
                            "gradients partial over tp (routers; SP: replicated params)"))
    out += tied_transfers(shape, c, pp_rank)
    out += _grad_sync("dp_cp", dp * cp, dense, c, "dense gradients")
    out += _grad_sync("edp", t * cp * dp // lay.ep, expert, c, "expert gradients")
    out += norm_transfers(clip_spread(shape, c), c.clip_grad)
    out += bias_transfers(shape, c, moe)
    states = _states(c, dense, dense_tensors, dp * cp)
    ex = _states(c, expert, expert_tensors, t * cp * dp // lay.ep)
    states = {k: states[k] + ex[k] for k in states}
    states["other"] += bias_state(shape, moe)
    return out, states


def bias_transfers(shape: Shape, c: HybridStep, moe: int) -> list[Transfer]:
    """The balancing bias's update (DeepSeek-V3 Sec. 2.1.2; Megatron-Core's
    ``get_updated_expert_bias``): once per step one all-reduce of the rank's ``[moe, E]``
    float32 loads (``moe``: its MoE layers) over the t cp d ranks of its pipeline stage,
    which together route the stage's tokens (axis ``tp_dp_cp``); none without the bias."""
    n = c.layout.tp * c.layout.cp * c.layout.dp
    if not shape.moe_bias_update_rate or not moe or n < 2:
        return []
    return [Transfer("tp_dp_cp", "all_reduce", n, moe * shape.num_experts * 4, 1,
                     "expert loads for the balancing bias (sum)")]


def bias_state(shape: Shape, moe: int) -> int:
    """The ``moe`` routers' balancing biases: E float32 each (model state "other")."""
    return 4 * shape.num_experts * moe if shape.moe_bias_update_rate else 0


def tied_transfers(shape: Shape, c: HybridStep, pp_rank: int) -> list[Transfer]:
    """The tied word embedding's gradient all-reduce on pipeline rank ``pp_rank`` (module
    docstring, embd): one all-reduce of the tp rank's V'/t x h rows over the two ranks that
    hold one copy each; nothing untied, with one stage, or where a rank holds both copies
    (the V placement, the bidirectional schedules) or neither."""
    lay = c.layout
    if not shape.tie_embeddings or num_stages(c.placement, lay.pp, c.chunks) == 1:
        return []
    first, last = tied_embedding_holder(c.placement, lay.pp, pp_rank, c.chunks)
    if first == last:
        return []
    numel = padded_vocab(shape.V, lay.tp) // lay.tp * shape.h
    return [Transfer("embd", "all_reduce", 2, numel * c.e, 1,
                     "tied word embedding grads (first and last stage)")]


def clip_spread(shape: Shape, c: HybridStep) -> dict[str, int]:
    """{axis: size} of the axes the reduced gradient is spread over, each carrying one
    all-reduce of the clipping norm: tp, pp; dp_cp (dense) and, for an MoE model, edp with
    ZeRO 1-3; ep for an MoE model. Axes of one rank are dropped by ``norm_transfers``."""
    lay = c.layout
    zero = c.options.data.zero_stage > 0
    out = {"tp": lay.tp, "pp": lay.pp}
    if zero:
        out["dp_cp"] = lay.dp * lay.cp
    if shape.num_experts:
        out["ep"] = lay.ep
        if zero:
            out["edp"] = lay.tp * lay.cp * lay.dp // lay.ep
    return out


def _states(c: HybridStep, numel: int, tensors: int, n: int) -> dict[str, int]:
    """Model states of one gradient group (``impls.hybrid.optimizer``'s layout): e bytes per
    parameter and per gradient; AdamW's two fp32 moments and a 4-byte step per stepped
    tensor; with bf16 (e = 2) the fp32 masters too (Rajbhandari et al. 2020 Sec. 3.1, K = 12).

    ZeRO-0 steps every parameter tensor. ZeRO 1-3 keep one flat buffer padded to a multiple
    of n and step the rank's shard of it (one tensor): ZeRO-1 keeps the full parameter and
    gradient buffers, ZeRO-2 the full parameters and the gradient shard, ZeRO-3 both shards
    (Sec. 5.1-5.3)."""
    if not numel:
        return {"params": 0, "grads": 0, "optimizer": 0, "other": 0}
    mixed = c.e != 4
    if c.options.data.zero_stage == 0:
        opt = (8 + (4 if mixed else 0)) * numel + 4 * tensors
        return {"params": c.e * numel, "grads": c.e * numel, "optimizer": opt, "other": 0}
    shard = -(-numel // n)
    full = shard * n
    opt = (8 + (4 if mixed else 0)) * shard + 4
    return {"params": c.e * (full if c.options.data.zero_stage < 3 else shard),
            "grads": c.e * (full if c.options.data.zero_stage == 1 else shard),
            "optimizer": opt, "other": 0}
