"""Megatron 1D with more tp ranks than K/V heads (``llama-tiny``: 4 query heads, 2 K/V heads,
tp=4; ``impls.tensor.gqa``), built wrongly:

- the K/V head of query group r mod g instead of r // (t/g): the rank's query heads attend
  with another group's keys and values (the index of the group confused with the rank's
  position among the ranks sharing it; Megatron-Core takes the block of rank // (t/g));
- the QKV output gathered with a backward that only keeps the rank's own slice of the
  gradient (Megatron-Core's ``gather_from_tensor_model_parallel_region``, whose backward is a
  split) instead of reduce-scattering it: the other ranks' contributions to this rank's QKV
  rows are lost.
"""
from __future__ import annotations

import torch

from impls.tensor import gqa
from impls.tensor.megatron import Megatron1D, MegatronSP
from impls.tensor.megatron_model import MegatronGPT

from .catalogue import mutant, with_model

GQA = {"model": "llama-tiny", "tp": "4", "num_microbatches": "2"}



def wrong_kv_query_group(self, qkv):
    """``query_group`` with the bug: the rank's K/V head is r mod g, not r // (t/g) (shared
    by the tensor and hybrid mutants: both stages gather QKV the same way)."""
    full = gqa.gather_qkv(qkv, self.group, self.tp)
    j, i = gqa.group_of(self.cfg, self.tp, self.rank)
    q, _, _ = gqa.split_group(full, self.cfg, j, i, self.tp)
    g = self.cfg.num_kv_heads or self.cfg.num_heads
    _, k, v = gqa.split_group(full, self.cfg, self.rank % g, i, self.tp)  # the bug
    return torch.cat([q, k, v], dim=-1)


class _WrongKVHead(MegatronGPT):
    query_group = wrong_kv_query_group


@mutant("tp-gqa-kv-head-rank-mod-g", base="tensor.megatron", overrides=GQA,
        bug="tp > num_kv_heads: rank r attends with K/V head r mod g, not r // (tp/g)")
class TPGQAWrongKVHead(with_model(Megatron1D, _WrongKVHead)):
    pass


class _SplitBackward(torch.autograd.Function):
    """All-gather along the last dim forward; backward keeps the rank's own slice."""

    @staticmethod
    def forward(ctx, x, group, size, rank):
        ctx.n, ctx.rank = x.shape[-1], rank
        return gqa.gather_qkv(x.detach(), group, size)

    @staticmethod
    def backward(ctx, grad):
        lo = ctx.rank * ctx.n
        return grad[..., lo:lo + ctx.n].contiguous(), None, None, None  # the bug: no sum


class _SplitGather(MegatronGPT):
    def query_group(self, qkv):
        full = _SplitBackward.apply(qkv, self.group, self.tp, self.rank)
        return gqa.local_qkv(full, self.cfg, self.tp, self.rank)


@mutant("tp-gqa-qkv-gather-split-backward", base="tensor.megatron-sp", overrides=GQA,
        bug="tp > num_kv_heads: the QKV output's gather splits its gradient backward "
            "instead of reduce-scattering it")
class TPGQASplitBackward(with_model(MegatronSP, _SplitGather)):
    pass
