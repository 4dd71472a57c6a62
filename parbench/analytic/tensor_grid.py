"""2D, 2.5D and 3D tensor parallelism, closed forms: per-rank parameters and model states,
the traffic of one step, and activation memory per layer, for the reference GPT.

- 2D: SUMMA (van de Geijn & Watts 1997) as Optimus uses it (Xu et al. 2021), a q x q grid,
  tp = q^2;
- 2.5D: Tesseract (Wang et al. 2021), q x q x d, tp = q^2 d;
- 3D: Bian et al. 2021, a q x q x q cube, tp = q^3.

The stated rules are those of ``parbench.analytic.tensor`` (fp32, AdamW, m micro-batches).
Pure functions of the model shape and the degrees; nothing from ``impls``.

The LLaMA blocks (Touvron et al. 2023) change the counts by the papers' rules, not the
communication pattern: RMSNorm (Zhang & Sennrich 2019, Eq. 4) has no mean, so a norm over the
split hidden dimension all-reduces one per-token sum (of squares) instead of LayerNorm's two,
and holds a weight only (h, not 2h); ``bias=false`` drops every linear's bias (and its share
of the replicated gradients' all-reduces); SwiGLU (Shazeer 2020, Eq. 6) makes fc1 h -> 2f
([gate; up]); grouped-query attention (Ainslie et al. 2023) makes QKV h -> h + 2 g d. The
grid's head split keeps each query head with its K/V head only when q divides g
(:func:`check_grid_heads`).
"""
from __future__ import annotations

from fractions import Fraction

from . import activations
from .clip import norm_transfers
from .comm import Transfer
from .params import dense_block_tensor_sizes, norm_tensor_sizes
from .shape import Shape, divides, require_positive_int
from .tensor import (RankParams, RootedCycle)


# ---------------------------------------------------------------------------------------
# 2D / 2.5D (SUMMA: Optimus, Tesseract) and 3D
# ---------------------------------------------------------------------------------------

def _isqrt_exact(n: int, what: str) -> int:
    r = int(round(n ** 0.5))
    for c in (r - 1, r, r + 1):
        if c > 0 and c * c == n:
            return c
    raise ValueError(what)


def summa_grid(tp: int, depth: int = 1) -> tuple[int, int]:
    """(q, d) of the q x q x d grid of 2.5D tensor parallelism (Wang et al. 2021): tp = q^2 d
    (d = 1: 2D, Xu et al. 2021)."""
    require_positive_int("tp", tp)
    require_positive_int("tp_depth", depth)
    if tp % depth:
        raise ValueError(f"tp_depth={depth} does not divide tp={tp} (2.5D needs tp = q^2 d)")
    q = _isqrt_exact(tp // depth, f"tp={tp} is not q^2 x tp_depth={depth} for an integer q "
                                  "(2D / 2.5D tensor parallelism needs a square grid)")
    return q, depth


def cube_grid(tp: int) -> int:
    """q of the q x q x q cube of 3D tensor parallelism (Bian et al. 2021): tp = q^3."""
    require_positive_int("tp", tp)
    q = round(tp ** (1 / 3))
    for c in (q - 1, q, q + 1):
        if c > 0 and c ** 3 == tp:
            return c
    raise ValueError(f"tp={tp} is not a cube q^3 (3D tensor parallelism)")


def check_grid_heads(shape: Shape, q: int) -> None:
    """Grouped-query attention on a grid whose QKV output is split into q head-aligned
    column blocks: block j holds query heads [j a/q, (j+1) a/q), which belong to K/V groups
    [j g/q, (j+1) g/q) -- whole K/V heads only when q divides g (no all-gather of a shared
    K/V head, unlike Megatron-Core's 1D split: ``analytic.gqa``)."""
    divides("q", q, "num_heads", shape.num_heads)
    g = shape.kv_heads
    if g % q:
        raise ValueError(f"num_kv_heads={g} is not a multiple of the grid's q={q}: each grid "
                         f"column holds num_heads/q query heads and must hold their K/V heads "
                         f"whole (q must divide num_kv_heads)")


def check_summa(shape: Shape, b: int, q: int, d: int) -> None:
    """The divisibility a 2.5D case needs: heads, K/V heads, hidden and ffn by q
    (head-aligned column blocks); the micro-batch by d q (whole sequences per batch block)."""
    check_grid_heads(shape, q)
    divides("q", q, "hidden_size", shape.h)
    divides("q", q, "ffn_hidden_size", shape.f)
    divides("d*q", d * q, "micro_batch_size", b)


def check_cube(shape: Shape, b: int, q: int) -> None:
    """The divisibility a 3D case needs: heads and K/V heads by q, every linear's output by
    q^2 (the weight's sub-blocks), the micro-batch by q^2."""
    check_grid_heads(shape, q)
    divides("q^2", q * q, "hidden_size", shape.h)
    divides("q^2", q * q, "ffn_hidden_size", shape.f)
    divides("q^2", q * q, "QKV width (num_heads + 2 num_kv_heads) head_dim",
            shape.h + 2 * shape.kv_hidden)
    divides("q^2", q * q, "micro_batch_size", b)


def _linears(shape: Shape) -> list[tuple[int, int]]:
    """(in, out) features of a layer's four linears: QKV (h -> h + 2 g d: 3h without GQA),
    projection, fc1 (h -> f, or 2f under SwiGLU's [gate; up]), fc2."""
    h, f = shape.h, shape.f
    return [(h, h + 2 * shape.kv_hidden), (h, h), (h, 2 * f if shape.gated else f), (f, h)]


def _grid_params(shape: Shape, q: int, weight_div: int) -> RankParams:
    """Parameters of one rank when every non-weight parameter holds one of q hidden blocks
    and each linear weight 1/weight_div of its elements; ``replicated`` counts the
    non-weight elements (replicated across the grid's other axes): each linear's bias (its
    output features / q; none without biases), 2L + 1 norms (2h or h each, / q), the
    embeddings. Tensors are the reference model's (``params.dense_block_tensor_sizes``)."""
    h, L = shape.h, shape.l
    weights = L * sum(i * o for i, o in _linears(shape)) // weight_div
    biases = L * sum(o for _, o in _linears(shape)) // q if shape.bias else 0
    lns = (2 * L + 1) * shape.norm_params // q
    emb = shape.V * h // q * (1 if shape.tie_embeddings else 2)
    pos = shape.s * h // q if shape.position_embeddings else 0
    replicated = biases + lns + emb + pos
    tensors = (1 + int(shape.position_embeddings) + L * len(dense_block_tensor_sizes(shape))
               + len(norm_tensor_sizes(shape)) + int(not shape.tie_embeddings))
    return RankParams(weights + replicated, tensors, replicated)


def summa_params(shape: Shape, q: int) -> RankParams:
    """A 2D / 2.5D rank: each linear weight's (i, j) block of a q x q split (the same on
    every depth layer), every other parameter its hidden block j (Optimus' layers)."""
    return _grid_params(shape, q, q * q)


def cube_params(shape: Shape, q: int) -> RankParams:
    """A 3D rank: each linear weight's (l, j, i) block of a q x q x q split, every other
    parameter one hidden block."""
    return _grid_params(shape, q, q ** 3)


def _grid_shared_terms(shape: Shape, tokens: int, q: int, hidden_axis: str, m: int,
                 e: int) -> list[Transfer]:
    """Norm statistics and the LM head's partial logits, per step: each LayerNorm
    all-reduces the per-token sum and the sum of squares over the hidden group (2 all-reduces
    of ``tokens`` fp32 values forward, 2 backward), each RMSNorm the sum of squares only
    (1 forward, 1 backward); the partial logits (tokens x V) are all-reduced forward."""
    norms = 2 * shape.l + 1
    per_norm = 2 if shape.norm == "rmsnorm" else 4
    what = "RMSNorm sum of squares" if shape.norm == "rmsnorm" else "LayerNorm mean and variance"
    return [Transfer(hidden_axis, "all_reduce", q, tokens * 4, per_norm * norms * m,
                     f"{what} (fwd, bwd)"),
            Transfer(hidden_axis, "all_reduce", q, tokens * shape.V * e, m,
                     "LM head partial logits (fwd)")]


def summa_step_traffic(shape: Shape, b: int, q: int, d: int = 1, num_microbatches: int = 1,
                       e: int = 4, clip_grad: float = 0.0) -> list[Transfer]:
    """Every collective of one 2D / 2.5D rank in one step.

    Per linear (in -> out features) per micro-batch, with A = T in/q e the rank's input block
    (T = b s / (d q) tokens) and B = in out / q^2 e its weight block: the forward SUMMA
    product broadcasts A along the grid row and B along the grid column in each of q rounds
    (Xu et al. 2021, Sec. 3.2; van de Geijn & Watts 1997); backward, dX = dY W^T broadcasts B
    along the column and reduces a partial dX (A bytes) along the row, and dW = X^T dY
    broadcasts A along the row and reduces a partial dW (B bytes) along the column, q rounds
    each. With the root visiting every rank once per q rounds (:class:`RootedCycle`) a rank
    sends 3 (q-1) A on ``tp_row`` and 3 (q-1) B on ``tp_col`` per linear -- the 3 (q-1)
    message rounds per product of Optimus' analysis (Colossal-AI's table: O(6(q-1)/q) over
    both axes at d = 1). Plus the LayerNorm and head terms of :func:`_grid_shared_terms`, and once
    per step an all-reduce over ``tp_col`` of the gradients of every parameter replicated over
    grid rows (biases, LayerNorms, embeddings) and, for d > 1, over ``tp_dep`` of every
    gradient (Tesseract, Sec. 3.2: the depth layers hold the same weights) -- the
    2(d-1)/d weight term of Tesseract's O(3(q-1)(d+1)/(dq)). With ``clip_grad``, the
    global norm's 4-byte all-reduce over the whole tp group (:func:`grid_norm_transfers`).
    """
    require_positive_int("micro_batch", b)
    check_summa(shape, b, q, d)
    m = num_microbatches
    T = b * shape.s // (d * q)  # noqa: N806
    out: list[Transfer] = []
    if q > 1:
        for i, o in _linears(shape):
            A, B = T * i // q * e, i * o // (q * q) * e  # noqa: N806
            what = f"SUMMA {i}->{o}"
            out += [RootedCycle("tp_row", "broadcast", q, A, 2 * q * shape.l * m,
                                f"{what}: X blocks (fwd, dW)"),
                    RootedCycle("tp_row", "reduce", q, A, q * shape.l * m,
                                f"{what}: partial dX"),
                    RootedCycle("tp_col", "broadcast", q, B, 2 * q * shape.l * m,
                                f"{what}: W blocks (fwd, dX)"),
                    RootedCycle("tp_col", "reduce", q, B, q * shape.l * m,
                                f"{what}: partial dW")]
        out += _grid_shared_terms(shape, T, q, "tp_row", m, e)
        rep = summa_params(shape, q).replicated
        out.append(Transfer("tp_col", "all_reduce", q, rep * e, 1,
                            "gradients replicated over grid rows (once per step)"))
    if d > 1:
        out.append(Transfer("tp_dep", "all_reduce", d, summa_params(shape, q).numel * e, 1,
                            "every gradient over the depth layers (once per step)"))
    return out + grid_norm_transfers(q * q * d, clip_grad)


def grid_norm_transfers(tp: int, clip_grad: float) -> list[Transfer]:
    """Clipping by global norm on a 2D / 2.5D / 3D grid: each rank adds the squares of the
    pieces no lower tp index holds (a weight block on depth layer 0, a hidden block on one
    rank of its replicas) and the sum is all-reduced once over the whole tp group (axis
    ``tp``), as Megatron-LM's ``clip_grad_norm_fp32`` does over its model-parallel group."""
    return norm_transfers({"tp": tp}, clip_grad)


def summa_paper_traffic(shape: Shape, b: int, q: int, d: int = 1,
                        num_microbatches: int = 1, e: int = 4) -> dict:
    """The transformer linears' share in the papers' terms: 3 SUMMA products of q rounds
    each per linear, 3 (q-1) (A + B) bytes per rank (Optimus Sec. 3.2, Tesseract Sec. 3.2),
    and Tesseract's depth all-reduce of the weight gradients, 2 (d-1)/d W."""
    T = b * shape.s // (d * q)  # noqa: N806
    summa = sum(3 * (q - 1) * (T * i // q + i * o // (q * q)) * e
                for i, o in _linears(shape)) * shape.l * num_microbatches
    weights = shape.l * sum(i * o for i, o in _linears(shape)) // (q * q) * e
    return {"summa_linears_per_step": summa,
            "depth_weight_allreduce": float(Fraction(2 * (d - 1), d) * weights) if d > 1 else 0}


def cube_step_traffic(shape: Shape, b: int, q: int, num_microbatches: int = 1,
                      e: int = 4, clip_grad: float = 0.0) -> list[Transfer]:
    """Every collective of one 3D rank in one step (Bian et al. 2021, Sec. 3).

    Per linear (K -> N features) per micro-batch, with T = b s / q^2 tokens per rank,
    X = T K/q e its input block, W = K N / q^3 e its weight block and Y = q T N/q e the
    partial product: forward all-gathers X over the input axis (q X gathered), W over
    ``tp_x`` (q W) and reduce-scatters Y over the output axis; backward all-gathers dY over
    the output axis and reduce-scatters dX (q X) over the input axis and dW (q W) over
    ``tp_x``. The input / output axes are y / z for QKV and fc1, z / y for the projection
    and fc2. That is 2 (q-1) X + 2 (q-1) W + 2 (q-1)/q Y per linear -- Colossal-AI's
    O(6(q-1)/q^3) in units of the full activation per axis pair. Plus the LayerNorm and head
    terms of :func:`_grid_shared_terms` on ``tp_z`` (the residual stream's hidden axis), and once
    per step the replicated parameters' gradients summed over their replica axes: all over
    ``tp_x``; those with features along z (LayerNorms, embeddings, projection and fc2 biases)
    over ``tp_y``; those along y (QKV and fc1 biases) over ``tp_z`` (no such call without
    biases). With ``clip_grad``,
    the norm's all-reduce over tp (:func:`grid_norm_transfers`).
    """
    require_positive_int("micro_batch", b)
    check_cube(shape, b, q)
    if q == 1:
        return []
    m, L = num_microbatches, shape.l
    T = b * shape.s // (q * q)  # noqa: N806
    out: list[Transfer] = []
    for n, (k, o) in enumerate(_linears(shape)):
        ax_in, ax_out = ("tp_y", "tp_z") if n in (0, 2) else ("tp_z", "tp_y")
        X, W, Y = T * k // q * e, k * o // q ** 3 * e, q * T * o // q * e  # noqa: N806
        what = f"3D {k}->{o}"
        out += [Transfer(ax_in, "all_gather", q, q * X, L * m, f"{what}: X (fwd)"),
                Transfer(ax_in, "reduce_scatter", q, q * X, L * m, f"{what}: dX (bwd)"),
                Transfer("tp_x", "all_gather", q, q * W, L * m, f"{what}: W (fwd)"),
                Transfer("tp_x", "reduce_scatter", q, q * W, L * m, f"{what}: dW (bwd)"),
                Transfer(ax_out, "reduce_scatter", q, Y, L * m, f"{what}: Y (fwd)"),
                Transfer(ax_out, "all_gather", q, Y, L * m, f"{what}: dY (bwd)")]
    out += _grid_shared_terms(shape, T, q, "tp_z", m, e)
    rep = cube_params(shape, q).replicated
    on_y = L * (_linears(shape)[0][1] + _linears(shape)[2][1]) // q if shape.bias else 0
    out += [Transfer("tp_x", "all_reduce", q, rep * e, 1, "replicated gradients over x"),
            Transfer("tp_y", "all_reduce", q, (rep - on_y) * e, 1,
                     "gradients of z-feature parameters over y")]
    if on_y:  # without biases nothing has its features along y
        out.append(Transfer("tp_z", "all_reduce", q, on_y * e, 1,
                            "gradients of y-feature biases over z"))
    return out + grid_norm_transfers(q ** 3, clip_grad)


# ---------------------------------------------------------------------------------------
# activation memory per layer (Korthikanti et al. 2022, Sec. 4, adapted)
# ---------------------------------------------------------------------------------------

def _attention_saved(T, h: int, a: int, q: int, kv_heads: int, rope: bool, s: int,  # noqa: N803
                     e: int, packed: bool = False) -> Fraction:
    """Bytes the attention of a rank's a/q heads keeps for backward on T tokens: q, k, v as
    ``activations.qkv_saved_elements`` counts them at h/q and g h/(a q) features (rotated by
    RoPE, K/V repeated over the query groups when grouped-query attention's g < a), the fused
    kernel's output (T h/q e, the projection's input a view of it) and log-sum-exp (T a/q
    fp32), RoPE's cos and sin tables (``activations.rope_table_bytes``, s x h/a; with
    ``packed`` documents one per sample of the rank's T/s, and the kernel's mask,
    ``activations.packed_mask_bytes`` of those samples)."""
    g = kv_heads or a
    qkv = activations.qkv_saved_elements(T, Fraction(h, q), Fraction(g * h // a, q),
                                         rope=rope, repeat=g < a)
    rows = T if packed else s
    tables = activations.rope_table_bytes(rows, h // a) if rope else 0
    mask = activations.packed_mask_bytes(Fraction(T, s), s) if packed else 0
    return (qkv + Fraction(T * h, q)) * e + 4 * Fraction(T * a, q) + tables + mask


def _mlp_saved(T, f: int, q: int, swiglu: bool, fc2_input_kept: bool,  # noqa: N803
               e: int) -> Fraction:
    """Bytes the MLP's activation keeps on T tokens of f/q features
    (``activations.mlp_saved_elements``; fc2 keeps its input ungathered in 2D / 2.5D)."""
    kept = activations.mlp_saved_elements(f, "swiglu" if swiglu else "gelu", fc2_input_kept)
    return Fraction(T * kept * e, q)


def summa_layer_activation_bytes(s: int, b: int, h: int, a: int, q: int, d: int = 1,
                                 ffn_hidden: int | None = None, e: int = 4, *,
                                 kv_heads: int = 0, rope: bool = False,
                                 swiglu: bool = False, packed: bool = False) -> float:
    """Bytes one layer of a 2D / 2.5D rank keeps for backward: Korthikanti et al.'s count
    (Sec. 4.1) for T = b s / (d q) tokens and hidden / q features, with the grid's own
    norm (elementwise ops around its all-reduces: LayerNorm keeps the centred input and the
    normalised output, T h/q e each, and 1/sigma, T fp32 values -- not torch's fused kernel's
    input, mean and 1/sigma; RMSNorm the input, the normalised output and 1/rms, the same
    count). Per layer: two norms; the inputs of QKV and fc1 (T h/q each); the attention
    (:func:`_attention_saved`: GPT-2's Q, K, V are views of QKV's output, 3 T h/q); the MLP
    (:func:`_mlp_saved`: GELU 2 T f/q, SwiGLU 4 T f/q). GPT-2 blocks: T e (10 h + 2 f)/q +
    8 T + 4 T a/q. ``packed``: documents packed in the rank's T/s samples (their own RoPE
    tables, the kernel's mask)."""
    f = 4 * h if ffn_hidden is None else ffn_hidden
    T = Fraction(b * s, d * q)  # noqa: N806
    norms_and_inputs = T * e * 6 * h / q + 8 * T
    return float(norms_and_inputs + _attention_saved(T, h, a, q, kv_heads, rope, s, e, packed)
                 + _mlp_saved(T, f, q, swiglu, True, e))


def cube_layer_activation_bytes(s: int, b: int, h: int, a: int, q: int,
                                ffn_hidden: int | None = None, e: int = 4, *,
                                kv_heads: int = 0, rope: bool = False,
                                swiglu: bool = False, packed: bool = False) -> float:
    """Bytes one layer of a 3D rank keeps for backward, T = b s / q^2 tokens per rank: the
    grid norm's 2 T h/q e + 4 T twice; every linear keeps its *gathered* input (q T
    tokens: T h e for QKV, the projection and fc1, T f e for fc2) and its gathered weight
    block (out/q x in/q, as Colossal-AI's ``linear_3d`` keeps them: QKV h + 2 g h/a outputs,
    fc1 2f under SwiGLU); the attention (:func:`_attention_saved`); the MLP's activation
    (:func:`_mlp_saved`, fc2 keeping the gathered product, not the rank's own). GPT-2
    blocks: T e (8 h/q + 3 h + f/q + f) + 8 T + 4 T a/q + e (4 h^2 + 2 h f)/q^2."""
    f = 4 * h if ffn_hidden is None else ffn_hidden
    T = Fraction(b * s, q * q)  # noqa: N806
    g = kv_heads or a
    outs = {"qkv": h + 2 * g * h // a, "proj": h, "fc1": 2 * f if swiglu else f, "fc2": h}
    weights = Fraction(e * (h * (outs["qkv"] + outs["proj"] + outs["fc1"]) + f * h), q * q)
    gathered = T * e * (3 * h + f)
    norms = T * e * 4 * h / q + 8 * T
    attention = _attention_saved(T, h, a, q, kv_heads, rope, s, e, packed)
    return float(norms + gathered + weights + attention
                 + _mlp_saved(T, f, q, swiglu, False, e))
