"""Grouped-query attention under context parallelism (issue 21): K and V have num_kv_heads
heads, each serving a group of num_heads / num_kv_heads consecutive query heads.

- Ulysses dealing the K/V heads to the ranks round-robin (rank i takes K/V heads i, i + u,
  ...) while the query heads go in contiguous blocks: every query group but the first meets
  another group's keys and values -- the head bookkeeping a GQA port of the sequence <-> head
  all-to-all has to get right (and which the golden check sees in the loss);
- ring attention with K and V repeated to every query head before the ring (the shortcut of
  ports that expand GQA first): the numbers are right, each K/V message num_heads /
  num_kv_heads times larger than it needs to be -- the wire bytes' closed form (K/V of the
  K/V heads, Liu et al. 2023 with GQA's narrower K/V) is what catches it.
"""
from __future__ import annotations

from impls.context.schemes import RingAttentionScheme, UlyssesScheme
from impls.context.ulysses import UlyssesRingCore

from .catalogue import mutant

#: LLaMA blocks with 8 query heads over 4 K/V heads (head_dim 4), so that each of cp = 2
#: ranks holds two K/V heads and a round-robin deal differs from a contiguous one
GQA = {"model": "llama-tiny", "num_heads": "8", "num_kv_heads": "4"}


class _StridedKVCore(UlyssesRingCore):
    def __call__(self, q, k, v):
        nkv, u = k.shape[2], self.u
        order = [j * u + i for i in range(u) for j in range(nkv // u)]
        return super().__call__(q, k[:, :, order], v[:, :, order])


@mutant("ulysses-gqa-kv-heads-strided", base="context.ulysses", overrides=GQA,
        bug="K/V heads dealt to the ranks round-robin, query heads in contiguous blocks "
            "(query groups meet another group's K/V)")
class UlyssesGqaStrided(UlyssesScheme):
    core_class = _StridedKVCore


class _ExpandedKVCore(UlyssesRingCore):
    def __call__(self, q, k, v):
        g = q.shape[2] // k.shape[2]
        k, v = (t.repeat_interleave(g, dim=2) for t in (k, v))
        return super().__call__(q, k, v)


@mutant("ring-gqa-kv-expanded", base="context.ring-attention", overrides=GQA,
        bug="K and V repeated to every query head before the ring (right numbers, K/V "
            "messages num_heads / num_kv_heads times too large)")
class RingGqaExpanded(RingAttentionScheme):
    core_class = _ExpandedKVCore

