"""LLaMA-style blocks (issue 21) built wrongly: the bugs of hand-written or converted
implementations, on the ``llama-tiny`` model.

- grouped-query attention's K/V heads tiled (``repeat``: K/V heads 0, 1, 0, 1) instead of
  repeated per group (``repeat_interleave``: 0, 0, 1, 1), so query head 1 reads the second
  group's keys -- the head-order mistake GQA ports make when they broadcast K/V;
- SwiGLU's fused fc1 read as [up; gate] instead of [gate; up] (Megatron's linear_fc1 order),
  the gate / up swap of checkpoint converters.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from parbench.model import MLP, Attention

from impls.data.ddp import NativeDDP
from impls.zero.replicated import Zero2

from .catalogue import mutant

LLAMA = {"model": "llama-tiny", "num_microbatches": "2"}


class _TiledKV(Attention):
    def heads(self, qkv, docs=None):
        # the model's own split and RoPE with one K/V head per query head, then the bug
        nq, nkv = self.num_heads, self.kv_heads
        self.kv_heads = nq
        try:
            b, s, _ = qkv.shape
            d = self.head_dim
            q, k, v = qkv.split([nq * d, nkv * d, nkv * d], dim=-1)
            k, v = (t.reshape(b, s, nkv, d).repeat(1, 1, nq // nkv, 1).reshape(b, s, nq * d)
                    for t in (k, v))
            return super().heads(torch.cat([q, k, v], dim=-1), docs)
        finally:
            self.kv_heads = nkv


class _UpGate(MLP):
    def forward(self, x):
        up, gate = self.fc1(x).chunk(2, dim=-1)
        return self.fc2(F.silu(gate) * up)


@mutant("ddp-gqa-kv-heads-tiled", base="data.ddp", overrides=LLAMA,
        bug="K/V heads tiled over the query heads (0,1,0,1) instead of per group (0,0,1,1)")
class DDPGQATiled(NativeDDP):
    def __init__(self, ctx):
        super().__init__(ctx)
        for blk in self.model.blocks.values():
            blk.attn.__class__ = _TiledKV


@mutant("zero2-swiglu-gate-up-swapped", base="zero.2", overrides=LLAMA,
        bug="SwiGLU's fused fc1 read as (up, gate) instead of (gate, up)")
class Zero2SwiGLUSwapped(Zero2):
    def __init__(self, ctx):
        super().__init__(ctx)
        for blk in self.model.blocks.values():
            blk.mlp.__class__ = _UpGate
