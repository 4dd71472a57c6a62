"""Grouped-query attention under tensor parallelism, as Megatron-Core splits it: the rule on tp
and num_kv_heads, the K/V heads a rank attends with, and the extra traffic when tp exceeds
the K/V heads.

GQA (Ainslie et al. 2023, "GQA: Training Generalized Multi-Query Transformer Models from
Multi-Head Checkpoints", Sec. 2) gives g = num_kv_heads K/V heads, each serving a group of
a / g consecutive query heads. Megatron-Core (``megatron/core/transformer/
transformer_config.py``, ``__post_init__``) accepts tp when g is a multiple *or a divisor* of
tp and refuses any other pair. What a tp rank holds and does (``megatron/core/transformer/
attention.py``, ``Attention.__init__`` and ``SelfAttention.get_query_key_value_tensors``;
read at NVIDIA/Megatron-LM d98e8a6):

- the fused ``linear_qkv`` is one column-parallel linear h -> (a + 2g) d whose output rows are
  interleaved group by group, [q heads of group 0, k_0, v_0 | q heads of group 1, k_1, v_1 |
  ...]; it is split evenly over the t ranks whatever g is, so (a + 2g) d / t rows a rank --
  *no weight is replicated*, the parameter count per rank is the plain column-parallel one;
- g >= t: a rank's rows are whole groups (g / t K/V heads, a / t query heads);
- g < t: a rank's rows are a 1/t slice of one group's block that cuts across its q, k and v
  rows, so no rank holds a clean set of heads. In forward each rank all-gathers the QKV
  output along its last dimension over the tp group (``all_gather_last_dim_from_tensor_
  parallel_region``), keeps the block of group r // (t / g), splits it into the group's
  query heads, k and v, and keeps query heads [(r mod (t/g)) a/t, ...) of the group: the
  rank attends with a / t query heads and one K/V head, that head's activations held on the
  t / g ranks of its group (the core attention is built with num_query_groups = t);
- the gradient: that all-gather's backward is a reduce-scatter along the same dimension
  (``mappings._AllGatherFromTensorParallelRegion``), so each rank's slice of the QKV output
  gradient is the sum of every rank's contribution -- the gradients of the weight shards
  are consistent by construction, with no reduction of weight gradients.

So with g < t each layer costs, per micro-batch, one all-gather forward and one
reduce-scatter backward of the QKV output, b s (a + 2g) d elements (the whole sequence: the
QKV input is the sequence-parallel all-gather's output under sp); full recomputation runs the
forward all-gather again in backward.
"""
from __future__ import annotations

from .comm import Transfer
from .shape import Shape, require_positive_int


def check_query_groups(shape: Shape, tp: int) -> None:
    """Megatron-Core's rule: tp divides num_kv_heads or num_kv_heads divides tp; below the
    heads the fused QKV output (a + 2g) d is split evenly over tp."""
    require_positive_int("tp", tp)
    g = shape.kv_heads
    if g % tp and tp % g:
        raise ValueError(f"tp={tp} and num_kv_heads={g}: one must divide the other "
                         "(Megatron-Core splits the query groups over tp, or each tp/g "
                         "ranks share one)")
    width = (shape.a + 2 * g) * shape.head_dim
    if gathers_qkv(shape, tp) and width % tp:
        raise ValueError(f"tp={tp} does not divide the fused QKV width (num_heads + "
                         f"2 num_kv_heads) head_dim={width} (column-parallel linear_qkv)")


def gathers_qkv(shape: Shape, tp: int) -> bool:
    """Does a rank all-gather the QKV output (tp > num_kv_heads, GQA without MLA)?"""
    return not shape.mla and shape.kv_heads < tp


def local_kv_heads(shape: Shape, tp: int) -> int:
    """K/V heads a rank attends with: g / t, or one when t exceeds g."""
    return max(shape.kv_heads // tp, 1)


def qkv_gather_transfers(shape: Shape, b: int, s: int, tp: int, recompute: str = "none",
                         e: int = 4, count: int = 1) -> list[Transfer]:
    """The all-gather (forward, again under full recompute) and reduce-scatter (backward) of
    the QKV output, S = b s (a + 2g) d e bytes, per layer per micro-batch (times ``count``);
    none when tp <= num_kv_heads."""
    if not gathers_qkv(shape, tp):
        return []
    S = b * s * (shape.a + 2 * shape.kv_heads) * shape.head_dim * e  # noqa: N806
    fwd = 2 if recompute == "full" else 1
    return [Transfer("tp", "all_gather", tp, S, fwd * count,
                     "GQA: QKV output gathered (tp > num_kv_heads; fwd, recompute)"),
            Transfer("tp", "reduce_scatter", tp, S, count,
                     "GQA: QKV output grad reduce-scattered (bwd)")]
