"""Grouped-query attention with more tensor-parallel ranks than K/V heads, as Megatron-Core
runs it (Ainslie et al. 2023, "GQA", Sec. 2: g = num_kv_heads K/V heads, each serving a/g
consecutive query heads).

What Megatron-Core does (read at NVIDIA/Megatron-LM d98e8a6; ``megatron/core/transformer/
attention.py``: ``Attention.__init__``, ``SelfAttention.__init__`` and
``get_query_key_value_tensors``; ``megatron/core/tensor_parallel/mappings.py``;
``transformer_config.py`` ``__post_init__``):

- the rule: num_query_groups must be a multiple or a divisor of the tp size;
- the weight: ``linear_qkv`` is one column-parallel linear to (a + 2g) d outputs laid out group
  by group, [a/g query heads of group 0, k_0, v_0 | group 1 ...], split into t equal row
  blocks whatever g is. With g < t a rank's block is a slice of one group's block that cuts
  across its q, k and v rows; nothing is replicated, so there is no replica whose gradient
  must be kept equal to another;
- the forward: every rank all-gathers its QKV output along the last dimension over the tp
  group, keeps the block of query group j = r // (t/g) and splits it into the group's query
  heads, k_j and v_j, then keeps its own a/t query heads, number r mod (t/g) of the group --
  so rank r attends with query heads [r a/t, (r+1) a/t), the heads whose columns of the
  row-parallel output projection it holds, and with the one K/V head of their group, which
  the t/g ranks of the group all hold (the core attention is built with num_query_groups = t);
- the backward: the all-gather's conjugate is a reduce-scatter along the same dimension
  (``_AllGatherFromTensorParallelRegion.backward``), so each rank's slice of the QKV output
  gradient sums the contributions of every rank that used it -- the gradients of the split
  weight are exact by construction, no reduction of weight gradients is needed.

Here the reference model's fused QKV is [Q (a heads); K (g heads); V (g heads)]; a rank holds
the reference rows its slice of Megatron-Core's interleaved order names (:func:`qkv_rows`), so
its local output columns are in that order and the all-gathered output is the interleaved one.
Traffic: ``parbench.analytic.gqa.qkv_gather_transfers``.
"""
from __future__ import annotations

import torch

from .collectives import GatherLastDim


def interleaved_rows(cfg) -> torch.Tensor:
    """The reference rows of the fused QKV in Megatron-Core's group-interleaved order."""
    d, a = cfg.head_dim, cfg.num_heads
    g = cfg.num_kv_heads or a
    per = a // g
    out = []
    for j in range(g):
        out += [torch.arange(j * per * d, (j + 1) * per * d),
                torch.arange((a + j) * d, (a + j + 1) * d),
                torch.arange((a + g + j) * d, (a + g + j + 1) * d)]
    return torch.cat(out)


def qkv_rows(cfg, tp: int, r: int) -> torch.Tensor:
    """Rank r's rows of the reference QKV: the r-th of t equal blocks of the interleaved
    order (Megatron-Core's column-parallel split of linear_qkv)."""
    rows = interleaved_rows(cfg)
    n = rows.numel() // tp
    return rows[r * n:(r + 1) * n]


def group_of(cfg, tp: int, r: int) -> tuple[int, int]:
    """(query group j, position i in it) of rank r: j = r // (t/g), i = r mod (t/g)."""
    per = tp // (cfg.num_kv_heads or cfg.num_heads)
    return r // per, r % per


def gather_qkv(qkv: torch.Tensor, group, tp: int) -> torch.Tensor:
    """All-gather the ranks' QKV outputs [s, b, (a+2g)d/t] -> [s, b, (a+2g)d] (interleaved);
    reduce-scatter of the gradient in backward."""
    return GatherLastDim.apply(qkv, group, tp)


def split_group(full: torch.Tensor, cfg, j: int, i: int, tp: int):
    """(q of the rank's a/t heads, k_j, v_j) from the gathered interleaved output: group j's
    block, its query heads i a/t.. of the group, its K and V head."""
    d, a = cfg.head_dim, cfg.num_heads
    g = cfg.num_kv_heads or a
    width = (a // g + 2) * d
    block = full[..., j * width:(j + 1) * width]
    q, k, v = block.split([a // g * d, d, d], dim=-1)
    n = a // tp * d
    return q[..., i * n:(i + 1) * n], k, v


def local_qkv(full: torch.Tensor, cfg, tp: int, r: int) -> torch.Tensor:
    """Rank r's [q; k; v] columns, as a rank holds them when t divides g (one K/V head)."""
    j, i = group_of(cfg, tp, r)
    return torch.cat(split_group(full, cfg, j, i, tp), dim=-1)
