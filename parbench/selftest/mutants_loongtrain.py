"""Realistic bugs in LoongTrain's 2D-Attention / Double-Ring-Attention (``impls.context.
loongtrain``, ``impls.context.double_ring``): each mutant replaces one piece -- the ring peers,
the outer hop, the mask plan, the head all-to-all -- and registers as a scheme of its own."""
from __future__ import annotations

from impls.context.double_ring import DoubleRingPeers
from impls.context.loongtrain import LoongTrainCore, LoongTrainScheme
from impls.context.ring import block_plan
from impls.context.ulysses import HeadsToSeq, SeqToHeads, _all_to_all

from .catalogue import mutant

#: a 4-rank context ring of two windows of two (zig-zag): inner and outer hops both happen
TWO_BY_TWO = {"cp": "4", "cp_ulysses": "1", "cp_window": "2", "cp_balance": "zigzag"}


# ---- the two rings ---------------------------------------------------------------------------


@mutant("loongtrain-rings-swapped", base="context.loongtrain", overrides=TWO_BY_TWO,
        bug="double ring built with the inner and outer rings' peers swapped (the window's "
            "group used for the hops between windows and the reverse)")
class LoongTrainRingsSwapped(LoongTrainScheme):
    def make_peers(self, ring_in, ring_out):
        return super().make_peers(ring_out, ring_in)


class _StaleOuterPeers(DoubleRingPeers):
    def forward_entry(self, entry, t):
        if t == 0:
            self._first = entry
        stale = self._first
        if t == self.windows - 1:
            self._first = None  # (hold no tensor between steps)
        return super().forward_entry(stale, t)  # the bug: own block, every outer step


@mutant("loongtrain-stale-outer-kv", base="context.loongtrain",
        overrides={"cp": "4", "cp_ulysses": "1", "cp_window": "1", "cp_balance": "zigzag"},
        bug="the outer ring forwards the rank's own K/V at every outer step instead of the "
            "block that entered its window (stale K/V after the first hop)")
class LoongTrainStaleOuterKV(LoongTrainScheme):
    def make_peers(self, ring_in, ring_out):
        good = super().make_peers(ring_in, ring_out)
        return _StaleOuterPeers(good.inner, good.outer, good.clock, good.balance)


class _InnerRankMaskPeers(DoubleRingPeers):
    def plan(self, src, n):
        # the bug: causal offsets from the inner ring ranks only (window index dropped)
        return block_plan(self.balance, self.inner.rank, src % self.w, n)


@mutant("loongtrain-inner-rank-mask", base="context.loongtrain", overrides=TWO_BY_TWO,
        bug="causal mask (zig-zag block plan) decided on inner-ring ranks only, not on the "
            "global ring ranks of the query and the K/V block")
class LoongTrainInnerRankMask(LoongTrainScheme):
    def make_peers(self, ring_in, ring_out):
        good = super().make_peers(ring_in, ring_out)
        return _InnerRankMaskPeers(good.inner, good.outer, good.clock, good.balance)


# ---- the head all-to-all ---------------------------------------------------------------------


def _seq_to_head_dim(x, group, u):
    b, n, heads, d = x.shape
    # the bug: the all-to-all scatters the head dimension d (split as u x d/u), not the heads
    send = x.reshape(b, n, heads, u, d // u).permute(3, 0, 1, 2, 4).contiguous()
    recv = _all_to_all(send, group)
    return recv.permute(1, 3, 0, 2, 4).reshape(b, heads // u, u * n, d)


class _HeadDimSeqToHeads(SeqToHeads):
    @staticmethod
    def forward(ctx, x, group, u):
        ctx.group, ctx.u = group, u
        return _seq_to_head_dim(x, group, u)


class _HeadDimCore(LoongTrainCore):
    seq_to_heads = _HeadDimSeqToHeads
    heads_to_seq = HeadsToSeq


@mutant("loongtrain-head-a2a-wrong-dim", base="context.loongtrain",
        overrides={"cp": "4", "cp_ulysses": "2", "cp_window": "1"},
        bug="the head group's sequence->heads all-to-all scatters the head dimension instead "
            "of the heads")
class LoongTrainHeadA2AWrongDim(LoongTrainScheme):
    core_class = _HeadDimCore
