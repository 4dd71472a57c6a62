"""Grouped-query attention under context parallelism (issue 21): K and V have num_kv_heads
heads, each serving a group of num_heads / num_kv_heads consecutive query heads.

- Ulysses dealing the K/V heads to the ranks round-robin (rank i takes K/V heads i, i + u,
  ...) while the query heads go in contiguous blocks: every query group but the first meets
  another group's keys and values -- the head bookkeeping a GQA port of the sequence <-> head
  all-to-all has to get right (and which the golden check sees in the loss);
- ring attention with K and V repeated to every query head before the ring (the shortcut of
  ports that expand GQA first): the numbers are right, each K/V message num_heads /
  num_kv_heads times larger than it needs to be -- the wire bytes' closed form (K/V of the
  K/V heads, Liu et al. 2023 with GQA's narrower K/V) is what catches it;
- Ring Self-Attention and LoongTrain with the query heads paired to the K/V heads by
  ``h % num_kv_heads`` (tiled, as ``repeat`` instead of ``repeat_interleave`` pairs them)
  instead of ``h // (num_heads / num_kv_heads)``: RSA's score rows, and LoongTrain's after
  its head all-to-all (a rank's 4 query heads over its 2 K/V heads), read another group's
  keys and values -- the golden check sees it in the loss;
- LoongTrain with K and V repeated to every query head before the head all-to-all: right
  numbers, every K/V all-to-all and double-ring block num_heads / num_kv_heads times too
  large -- caught by the closed form's bytes at the K/V width.
"""
from __future__ import annotations

import torch

from impls.context.double_ring import DoubleRingAttention
from impls.context.loongtrain import LoongTrainCore, LoongTrainScheme
from impls.context.rsa import RingSelfAttention, RSACore
from impls.context.schemes import RingAttentionScheme, RingSelfAttentionScheme, UlyssesScheme
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


class _ExpandKV:
    """Mixin for a core: K and V repeated to every query head before it runs."""

    def __call__(self, q, k, v):
        g = q.shape[2] // k.shape[2]
        k, v = (t.repeat_interleave(g, dim=2) for t in (k, v))
        return super().__call__(q, k, v)


class _ExpandedKVCore(_ExpandKV, UlyssesRingCore):
    pass


@mutant("ring-gqa-kv-expanded", base="context.ring-attention", overrides=GQA,
        bug="K and V repeated to every query head before the ring (right numbers, K/V "
            "messages num_heads / num_kv_heads times too large)")
class RingGqaExpanded(RingAttentionScheme):
    core_class = _ExpandedKVCore



def _tiled_pairs(attention):
    """``attention`` (an autograd Function on (b, heads, n, d) queries and (b, kv heads, n, d)
    keys / values) with query head h reading K/V head h % kv instead of h // (heads / kv):
    the query heads are reordered so that the kernels' contiguous groups hold heads of equal
    h % kv, and the output is put back in order."""
    class Tiled:
        @staticmethod
        def apply(q, k, v, ring):
            heads, kv = q.shape[1], k.shape[1]
            order = [i * kv + r for r in range(kv) for i in range(heads // kv)]
            back = torch.argsort(torch.tensor(order)).tolist()
            return attention.apply(q[:, order], k, v, ring)[:, back]
    return Tiled


class _TiledRSACore(RSACore):
    attention = _tiled_pairs(RingSelfAttention)


@mutant("rsa-gqa-kv-heads-tiled", base="context.ring-self-attention", overrides=GQA,
        bug="Ring Self-Attention's score rows pair query head h with K/V head h % "
            "num_kv_heads instead of h // (num_heads / num_kv_heads)")
class RSAGqaTiled(RingSelfAttentionScheme):
    core_class = _TiledRSACore


#: a 2 x 2 head x context grid: after the head all-to-all a rank holds 4 query heads over 2
#: K/V heads, so a wrong pairing inside the rank shows
LOONG_GQA = {**GQA, "cp": "4", "cp_ulysses": "2", "cp_balance": "zigzag"}


class _TiledLoongCore(LoongTrainCore):
    attention = _tiled_pairs(DoubleRingAttention)


@mutant("loongtrain-gqa-kv-heads-tiled", base="context.loongtrain", overrides=LOONG_GQA,
        bug="after the head all-to-all query head h is paired with K/V head h % (the rank's "
            "K/V heads) instead of h // (its query heads per K/V head)")
class LoongTrainGqaTiled(LoongTrainScheme):
    core_class = _TiledLoongCore


class _ExpandedLoongCore(_ExpandKV, LoongTrainCore):
    pass


@mutant("loongtrain-gqa-kv-expanded", base="context.loongtrain", overrides=LOONG_GQA,
        bug="K and V repeated to every query head before the head all-to-all (right numbers; "
            "K/V all-to-alls and double-ring blocks num_heads / num_kv_heads times too large)")
class LoongTrainGqaExpanded(LoongTrainScheme):
    core_class = _ExpandedLoongCore
