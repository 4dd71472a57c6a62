"""Tensor parallelism, closed forms: per-rank parameters and model states, and the traffic of
one training step, for Megatron 1D (Shoeybi et al. 2019), Megatron sequence parallelism
(Korthikanti et al. 2022), 2D (SUMMA / Optimus, Xu et al. 2021), 2.5D (Tesseract, Wang et al.
2021) and 3D (Bian et al. 2021) tensor parallelism of the reference GPT.

Pure functions of the model shape and the degrees; no torch, nothing from ``impls``. The
stated implementation rules the formulas count:

- the vocabulary is padded to V' = t * ceil(V / t) (Megatron's
  ``--make-vocab-size-divisible-by`` with divisor 1; Megatron's default is 128 * t); the padding
  rows are parameters (zeros) and their logits are masked;
- fp32 parameters, gradients and activations (e = 4 bytes); AdamW keeps two moments per
  element and one fp32 step counter per tensor; SGD keeps nothing;
- one micro-batch is b sequences of s tokens; a step runs m of them, then one optimizer step.

Communication follows :mod:`parbench.analytic.comm` (message bytes S, ring wire factors).
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from .clip import norm_transfers
from .params import (attention_params, dense_block_tensor_sizes, norm_tensor_sizes,
                     shape_mlp_params)
from .gqa import check_query_groups, qkv_gather_transfers
from .comm import Transfer, as_number, tp_traffic, tp_vocab_traffic, wire_factor
from .mla import mla_replicated_params, mla_tp_input_width
from .shape import Shape, divides, require_positive_int

RECOMPUTE = ("none", "selective", "full")


def padded_vocab(vocab: int, tp: int, divisible_by: int = 1) -> int:
    """V' = the smallest multiple of ``divisible_by * tp`` not below V (Megatron-LM,
    ``_vocab_size_with_padding``)."""
    require_positive_int("vocab_size", vocab)
    require_positive_int("tp", tp)
    mult = divisible_by * tp
    return -(-vocab // mult) * mult


# ---------------------------------------------------------------------------------------
# model states
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RankParams:
    """One rank's parameters: elements, tensors, and the elements a tp-replicated parameter
    holds (LayerNorms, row-parallel biases, position embedding: Megatron-SP all-reduces
    their gradients)."""

    numel: int
    tensors: int
    replicated: int


def model_states(p: RankParams, optimizer: str = "adamw", e: int = 4) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state one rank holds after a step, in
    the memory tracker's categories (fp32; AdamW: 2 moments + a 4-byte step per tensor)."""
    opt = 2 * e * p.numel + 4 * p.tensors if optimizer == "adamw" else 0
    return {"params": e * p.numel, "grads": e * p.numel, "optimizer": opt, "other": 0}


def megatron_params(shape: Shape, tp: int) -> RankParams:
    """Parameters of one Megatron 1D rank (Shoeybi et al. 2019, Sec. 3): vocab-parallel
    embedding and head (V' h / t each; one when tied), column-parallel QKV and fc1 (weight and
    bias / t; QKV with its query groups' K/V heads, fc1 with SwiGLU's gate and up rows:
    ``params.attention_params`` / ``shape_mlp_params``), row-parallel projection and fc2
    (weight / t, bias whole), the norms (LayerNorm or RMSNorm) and the position embedding
    whole. Tensors are the reference model's (``params.dense_block_tensor_sizes``)."""
    _check(shape, tp)
    h, L, norm = shape.h, shape.l, shape.norm_params
    vp = padded_vocab(shape.V, tp)
    pos = shape.s * h if shape.position_embeddings else 0
    attn = attention_params(shape, tp)
    layer = attn["qkv"] + attn["proj"] + shape_mlp_params(shape, tp) + 2 * norm
    layer_repl = 2 * norm + (2 * h if shape.bias else 0)  # norms, proj and fc2 biases
    layer_repl += mla_replicated_params(shape) if shape.mla else 0  # MLA's down projections
    replicated = pos + L * layer_repl + norm
    numel = vp * h // tp * (1 if shape.tie_embeddings else 2) + L * layer + pos + norm
    tensors = (1 + int(shape.position_embeddings) + L * len(dense_block_tensor_sizes(shape))
               + len(norm_tensor_sizes(shape)) + int(not shape.tie_embeddings))
    return RankParams(numel, tensors, replicated)


def _check(shape: Shape, tp: int) -> None:
    require_positive_int("tp", tp)
    divides("tp", tp, "num_heads", shape.num_heads)
    divides("tp", tp, "ffn_hidden_size", shape.f)
    check_query_groups(shape, tp)


# ---------------------------------------------------------------------------------------
# Megatron 1D and sequence parallelism: traffic of one step
# ---------------------------------------------------------------------------------------

def megatron_step_traffic(shape: Shape, b: int, tp: int, num_microbatches: int = 1,
                          recompute: str = "none", sp: bool = False,
                          e: int = 4, clip_grad: float = 0.0) -> list[Transfer]:
    """Every tp collective of one rank in one step (m micro-batches of b sequences).

    Without sequence parallelism (Shoeybi et al. 2019, Sec. 3; :func:`comm.tp_traffic` and
    :func:`comm.tp_vocab_traffic`): per layer per micro-batch 2 all-reduces forward (``g``)
    and 2 backward (``f``) of S = b s h e bytes -- 8 S (t-1)/t on the wire -- and 2 more with
    full recomputation; the embedding output is all-reduced forward, the LM head's input
    gradient backward, and the vocab-parallel loss all-reduces 3 fp32 values per token.

    With sequence parallelism (Korthikanti et al. 2022, Sec. 4.2.2, Fig. 5) each all-reduce
    becomes an all-gather and a reduce-scatter of the same S -- the paper's "same bandwidth":
    per layer 2 all-gathers and 2 reduce-scatters forward, and backward the 2 all-gathers
    conjugate to the forward reduce-scatters and the 2 reduce-scatters conjugate to the
    forward all-gathers. Because the column-parallel linears keep only the sequence shard of
    their input (which is what gives Eq. 3's activation memory), backward all-gathers it once
    more before the weight gradient: 2 further all-gathers per layer (the paper overlaps them
    with computation and leaves them out of its count). The embedding reduce-scatters its
    partial lookups (all-gather backward) and adds its shard of the position embedding; the
    LM head all-gathers its input (again in backward) and reduce-scatters the input gradient.
    Once per step the gradients of the parameters replicated over tp (LayerNorms, row-parallel
    biases, position embedding) are all-reduced in one buffer, as Megatron does for
    ``sequence_parallel`` parameters. With ``clip_grad``, the global norm's 4-byte
    all-reduce over tp (``analytic.clip``; Megatron-LM's ``clip_grad_norm_fp32``). With
    tp > num_kv_heads, per layer per micro-batch the QKV output's all-gather and
    reduce-scatter (:func:`.gqa.qkv_gather_transfers`; Megatron-Core's GQA split), sp or not.
    """
    _check(shape, tp)
    require_positive_int("micro_batch", b)
    require_positive_int("microbatches", num_microbatches)
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute={recompute!r} must be one of {', '.join(RECOMPUTE)}")
    if tp == 1:
        return []
    s, h, L, m = shape.s, shape.h, shape.l, num_microbatches
    full = recompute == "full"
    norm = norm_transfers({"tp": tp}, clip_grad) + \
        qkv_gather_transfers(shape, b, s, tp, recompute, e, L * m)
    if not sp:
        layers = mla_layer_traffic(shape, b, tp, L * m, e, full) if shape.mla else \
            tp_traffic(b, s, h, tp, L, m, e, full)
        return layers + tp_vocab_traffic(b, s, h, tp, m, e, loss_bytes=4) + norm
    S = b * s * h * e  # noqa: N806
    layers = mla_sp_layer_traffic(shape, b, tp, L * m, e, full) if shape.mla else \
        megatron_layer_traffic(b, s, h, tp, recompute, sp, e, L * m)
    return layers + [
        Transfer("tp", "reduce_scatter", tp, S, m, "embedding partial lookups (fwd)"),
        Transfer("tp", "all_gather", tp, S, m, "embedding output grad (bwd)"),
        Transfer("tp", "all_gather", tp, S, 2 * m, "LM head input (fwd, bwd re-gather)"),
        Transfer("tp", "reduce_scatter", tp, S, m, "LM head input grad (bwd)"),
        Transfer("tp", "all_reduce", tp, b * s * 4, 3 * m, "vocab-parallel cross-entropy"),
        Transfer("tp", "all_reduce", tp, e * megatron_params(shape, tp).replicated, 1,
                 "sequence-parallel parameter gradients (once per step)"),
    ] + norm


def mla_layer_traffic(shape: Shape, b: int, tp: int, count: int, e: int = 4,
                      full: bool = False) -> list[Transfer]:
    """Megatron 1D with multi-head latent attention, ``count`` layer micro-batches: the
    attention's ``g`` after its row-parallel projection and the MLP's ``f`` and ``g`` are
    all-reduces of S = b s h e as in :func:`comm.tp_traffic` (the forward ones twice with
    full recomputation); the attention's ``f`` sits after the replicated down projections
    (as Megatron-Core's column-parallel up projections take it), an all-reduce in backward
    of b s w e, w = ``mla.mla_tp_input_width`` (the query latent or h, the K/V latent, the
    shared rotary key), so that the replicated weights' gradients are whole on every rank."""
    S = b * shape.s * shape.h * e  # noqa: N806
    return [Transfer("tp", "all_reduce", tp, S, (5 if full else 3) * count,
                     "g (fwd, recompute) / MLP f (bwd)"),
            Transfer("tp", "all_reduce", tp, b * shape.s * mla_tp_input_width(shape) * e,
                     count, "MLA f (bwd): latents, query input and rotary key")]


def mla_sp_layer_traffic(shape: Shape, b: int, tp: int, count: int, e: int = 4,
                         full: bool = False) -> list[Transfer]:
    """Megatron sequence parallelism with multi-head latent attention, ``count`` layer
    micro-batches: the MLP as in :func:`megatron_layer_traffic` (fc1's input all-gathered
    forward and again backward, its gradient reduce-scattered; fc2's output reduce-scattered,
    all-gathered backward) and the attention's projection reduce-scattered forward and
    all-gathered backward, each of S = b s h e; the duplicated down projections run on the
    sequence shard and their outputs [query input, K/V latent, rotary key] are all-gathered
    forward, reduce-scattered backward: b s w e, w = ``mla.mla_tp_input_width``. Full
    recomputation repeats the forward ones."""
    S = b * shape.s * shape.h * e  # noqa: N806
    W = b * shape.s * mla_tp_input_width(shape) * e  # noqa: N806
    again = int(full)
    return [Transfer("tp", "all_gather", tp, S, (4 + again) * count,
                     "fc1 input (fwd, recompute, bwd re-gather), proj / fc2 g-bar (bwd)"),
            Transfer("tp", "reduce_scatter", tp, S, (3 + 2 * again) * count,
                     "proj / fc2 output (fwd, recompute), fc1 input grad (bwd)"),
            Transfer("tp", "all_gather", tp, W, (1 + again) * count,
                     "MLA latents, query input and rotary key (fwd, recompute)"),
            Transfer("tp", "reduce_scatter", tp, W, count, "their gradient (bwd)")]


@dataclass(frozen=True)
class RootedCycle(Transfer):
    """``count`` calls of a rooted op (broadcast, reduce) whose root visits the n ranks of
    the group in turn (SUMMA's rounds), ``count`` a multiple of n. A rank sends S in every
    call but one per cycle of n -- a broadcast's last rank of the chain from the root, a
    reduce's root (:func:`comm.rooted_wire_factor`) -- so every rank sends
    count (n-1)/n S."""

    @property
    def wire_bytes(self) -> int | float:
        """Per call, averaged over the cycle."""
        return as_number(Fraction(self.group_size - 1, self.group_size) *
                         Fraction(self.message_bytes))

    @property
    def total_wire_bytes(self) -> int | float:
        return as_number(self.exact_wire)

    @property
    def exact_wire(self) -> Fraction:
        return Fraction(self.group_size - 1, self.group_size) * Fraction(self.message_bytes) \
            * self.count


def _exact_wire(t: Transfer) -> Fraction:
    if isinstance(t, RootedCycle):
        return t.exact_wire
    return wire_factor(t.op, t.group_size) * Fraction(t.message_bytes) * t.count


def per_axis(transfers: list[Transfer]) -> tuple[dict[str, float], dict[str, int]]:
    """(wire bytes per axis, calls per axis) of one rank: exact sums, then floats; calls
    count collectives on groups of more than one rank (the ledger's rule)."""
    wire: dict[str, Fraction] = {}
    calls: dict[str, int] = {}
    for t in transfers:
        if t.group_size < 2 or t.count == 0:
            continue
        wire[t.axis] = wire.get(t.axis, Fraction(0)) + _exact_wire(t)
        calls[t.axis] = calls.get(t.axis, 0) + t.count
    return {a: float(v) for a, v in wire.items()}, calls


def megatron_layer_traffic(b: int, s: int, h: int, tp: int, recompute: str = "none",
                           sp: bool = False, e: int = 4, count: int = 1) -> list[Transfer]:
    """The transformer layers' share of :func:`megatron_step_traffic`: one layer, one
    micro-batch of b sequences of s tokens (times ``count``). Without sequence parallelism
    4 all-reduces of S = b s h e (6 with full recomputation); with it 2 all-gathers + 2
    reduce-scatters forward (twice with full recomputation) and 4 all-gathers + 2
    reduce-scatters backward (the 2 conjugates of each and the column-parallel inputs'
    re-gather)."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute={recompute!r} must be one of {', '.join(RECOMPUTE)}")
    if tp == 1:
        return []
    full = recompute == "full"
    if not sp:
        return tp_traffic(b, s, h, tp, count, 1, e, full)
    if s % tp:
        raise ValueError(f"sp with tp={tp} needs tp to divide seq_length={s}")
    S = b * s * h * e  # noqa: N806
    fwd = 2 * (2 if full else 1)  # forward (and its recomputation): 2 AG + 2 RS per layer
    return [Transfer("tp", "all_gather", tp, S, (fwd + 4) * count,
                     "layers: before QKV/fc1 (fwd, recompute, bwd re-gather), g-bar conjugate"),
            Transfer("tp", "reduce_scatter", tp, S, (fwd + 2) * count,
                     "layers: after proj/fc2 (fwd, recompute), g conjugate (bwd)")]


def per_rank(transfers: list[Transfer], world: int) -> tuple[list[dict], list[dict]]:
    """(wire bytes per axis, calls per axis) for each of ``world`` ranks with equal traffic."""
    wire, calls = per_axis(transfers)
    return [dict(wire) for _ in range(world)], [dict(calls) for _ in range(world)]


def megatron_paper_traffic(shape: Shape, b: int, tp: int, num_microbatches: int = 1,
                           recompute: str = "none", sp: bool = False, e: int = 4) -> dict:
    """The papers' own counts beside the exact ones: 8 b s h (t-1)/t bytes per layer per
    micro-batch (TARGETS.md; Korthikanti et al. 2022 Sec. 4.2.2: 4 all-reduces, or 4
    all-gathers + 4 reduce-scatters with sequence parallelism, "the same bandwidth"),
    12 b s h (t-1)/t with full recomputation; transformer layers only."""
    per_layer = Fraction(2 * (tp - 1), tp) * b * shape.s * shape.h * e * \
        (6 if recompute == "full" else 4)
    total = per_layer * shape.l * num_microbatches
    return {"per_layer_per_microbatch": float(per_layer), "layers_per_step": float(total),
            "collectives_per_layer": (6 if recompute == "full" else 4) * (2 if sp else 1)}
