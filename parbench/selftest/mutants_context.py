"""Realistic bugs in the context-parallel family (see mutants_data): each mutant replaces one
piece of a native scheme -- a ring's mask plan or merge, a layout, an all-to-all, the position
embeddings, the gradient reduction -- and registers as a scheme of its own."""
from __future__ import annotations

import torch
import torch.distributed as dist

from impls.context import layout
from impls.context.allgather import GatherGroup
from impls.context.kernels import attn_forward
from impls.context.ring import RingAttention, RingPeers, _rows
from impls.context.schemes import (AllGatherScheme, RingAttentionScheme,
                                   RingSelfAttentionScheme, UlyssesScheme, USPScheme)
from impls.context.ulysses import HeadsToSeq, SeqToHeads, UlyssesRingCore, _all_to_all

from .catalogue import mutant
from .optimizers import make_buggy_optimizer

# ---- ring attention: masks, merge, ring steps --------------------------------------------------


class _LocalCausalPeers(RingPeers):
    def plan(self, src, n):
        return [((0, n), (0, n), True)]  # the bug: causal on local indices for every block


@mutant("ring-local-causal", base="context.ring-attention", overrides={"cp_balance": "none"},
        bug="causal mask applied on local indices of every K/V block instead of global "
            "positions")
class RingLocalCausal(RingAttentionScheme):
    peers_class = _LocalCausalPeers


class _StripedDiagonalPeers(RingPeers):
    def plan(self, src, n):
        if src > self.rank:  # the bug: <= instead of < for blocks of later ranks
            return [((0, n), (0, n), True)]
        return super().plan(src, n)


@mutant("ring-striped-diagonal", base="context.ring-attention",
        overrides={"cp_balance": "striped"},
        bug="striped layout: blocks of later ranks attend to their diagonal (off by one)")
class RingStripedDiagonal(RingAttentionScheme):
    peers_class = _StripedDiagonalPeers


class _NoRescalePeers(RingPeers):
    def merge(self, out, lse, blk_out, blk_lse):
        new = torch.logaddexp(lse, blk_lse)
        out.add_(blk_out * torch.exp(blk_lse - new).unsqueeze(-1))  # the bug: old rows kept
        lse.copy_(new)


@mutant("ring-no-rescale", base="context.ring-attention",
        bug="online softmax: the running output is not rescaled when a block raises the "
            "log-sum-exp")
class RingNoRescale(RingAttentionScheme):
    peers_class = _NoRescalePeers


class _SkipLastStep(RingAttention):
    @staticmethod
    def forward(ctx, q, k, v, ring):
        n, size, rank = q.shape[2], ring.size, ring.rank
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        for j in range(size - 1):  # the bug: the last K/V block is never attended to
            pending = ring.exchange(kv, 7) if j < size - 1 else None
            for qs, ks, causal in ring.plan((rank - j) % size, n):
                o, lb = attn_forward(_rows(q, qs), _rows(kv[0], ks), _rows(kv[1], ks), causal)
                ring.merge(_rows(out, qs), _rows(lse, qs), o, lb)
            if pending is not None:
                kv = pending.wait()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = ring
        return out


class _SkipLastStepCore(UlyssesRingCore):
    attention = _SkipLastStep


@mutant("ring-skip-step", base="context.ring-attention", overrides={"cp_balance": "none"},
        bug="the K/V ring loop runs cp-1 steps: the last block received is never used")
class RingSkipStep(RingAttentionScheme):
    core_class = _SkipLastStepCore


class _ReversedHopPeers(RingPeers):
    def hop_peers(self):
        to, frm = super().hop_peers()
        return frm, to  # the bug: the all-to-all's splits swapped, the ring turns backwards


@mutant("ring-hop-reversed", base="context.ring-attention", overrides={"cp": "4"},
        bug="a ring hop as an all-to-all (gloo) with its send and receive splits swapped: "
            "each block goes to the previous rank, so step j attends block r + j, not r - j")
class RingHopReversed(RingAttentionScheme):
    peers_class = _ReversedHopPeers


class _OverwritingPeers(RingPeers):
    def land(self, own, returned):
        return returned  # the bug: = instead of +=


@mutant("ring-dkv-overwrite", base="context.ring-attention",
        bug="backward: the returning dK/dV accumulator overwrites the owner's own block "
            "gradient instead of adding to it")
class RingDKVOverwrite(RingAttentionScheme):
    peers_class = _OverwritingPeers


@mutant("ring-zigzag-order", base="context.ring-attention", overrides={"cp_balance": "zigzag"},
        bug="zig-zag layout with the two chunks in the wrong order (2cp-1-r before r)")
class RingZigzagOrder(RingAttentionScheme):
    def token_positions(self):
        pos = super().token_positions()
        half = len(pos) // 2
        return torch.cat([pos[half:], pos[:half]])


# ---- position embeddings and gradient reduction ------------------------------------------------


@mutant("cp-pos-embed-local", base="context.ring-attention",
        bug="position embeddings of local indices 0..n-1 (the single-device code) instead of "
            "the rank's global positions")
class PosEmbedLocal(RingAttentionScheme):
    @staticmethod
    def embed(model, tokens, pos):
        e = model.embed
        return e.tok(tokens) + e.pos.weight[: tokens.shape[1]]


@mutant("cp-pos-embed-wrong-shard", base="context.ulysses",
        bug="position embeddings of the neighbouring rank's shard")
class PosEmbedWrongShard(UlyssesScheme):
    @staticmethod
    def embed(model, tokens, pos):
        e = model.embed
        shifted = (pos + pos.numel()) % model.cfg.seq_length
        return e.tok(tokens) + e.pos.weight[shifted]


@mutant("cp-no-grad-allreduce", base="context.ring-attention",
        bug="parameter gradients are not all-reduced over the cp ranks (only divided)")
class NoGradAllReduce(RingAttentionScheme):
    def reduce_gradients(self):
        self.grads.buffer.div_(self.cp * self.dp)


@mutant("cp-grad-over-dp-only", base="context.ulysses",
        bug="gradients all-reduced over the dp group instead of dp x cp")
class GradOverDpOnly(UlyssesScheme):
    def reduce_gradients(self):
        dist.all_reduce(self.grads.buffer, group=self.ctx.mesh.group("dp"))
        self.grads.buffer.div_(self.cp * self.dp)


# ---- Ulysses, USP, RSA, all-gather -------------------------------------------------------------


def _seq_to_strided_heads(x, group, u):
    b, n, heads, d = x.shape
    # the bug: heads split as (heads/u, u) -- rank j gets heads j, j+u, ... -- while the
    # return trip reassembles contiguous head groups
    send = x.reshape(b, n, heads // u, u, d).permute(3, 0, 1, 2, 4).contiguous()
    recv = _all_to_all(send, group)
    return recv.permute(1, 3, 0, 2, 4).reshape(b, heads // u, u * n, d)


class _StridedSeqToHeads(SeqToHeads):
    @staticmethod
    def forward(ctx, x, group, u):
        ctx.group, ctx.u = group, u
        return _seq_to_strided_heads(x, group, u)


class _WrongHeadsCore(UlyssesRingCore):
    seq_to_heads = _StridedSeqToHeads
    heads_to_seq = HeadsToSeq


@mutant("ulysses-wrong-head-split", base="context.ulysses",
        bug="the sequence->heads all-to-all scatters strided heads, the heads->sequence one "
            "gathers contiguous groups")
class UlyssesWrongHeadSplit(UlyssesScheme):
    core_class = _WrongHeadsCore


@mutant("usp-cp-layout", base="context.usp", overrides={"cp": "4", "cp_ulysses": "2"},
        bug="USP lays the tokens out over all cp ranks instead of over the ring ranks "
            "(the Ulysses gather no longer yields the ring's zig-zag shard)")
class USPCpLayout(USPScheme):
    def token_positions(self):
        return layout.positions(self.ctx.model.seq_length, self.cp, self.cp_rank,
                                self.balance(self.ctx.case))


class _UnsummedPeers(RingPeers):
    def sum_over_ring(self, t):
        return t  # the bug: every rank keeps its own partial dV, dK of the sequence


@mutant("rsa-unsummed-dkv", base="context.ring-self-attention",
        bug="Ring Self-Attention backward uses this rank's partial dK, dV of the whole "
            "sequence without summing them over the ring")
class RSAUnsummedDKV(RingSelfAttentionScheme):
    peers_class = _UnsummedPeers


class _LocalMaskGroup(GatherGroup):
    def mask(self, device):
        n = len(self.positions[self.rank])
        q = torch.arange(n, device=device)  # the bug: local query indices
        k = torch.tensor([x for p in self.positions for x in p], device=device)
        return k[None, :] <= q[:, None]


@mutant("allgather-local-mask", base="context.allgather",
        bug="all-gather CP masks with local query indices instead of global positions")
class AllGatherLocalMask(AllGatherScheme):
    gather_class = _LocalMaskGroup


# ---- the optimizer on a context-parallel replica -------------------------------------------------


@mutant("cp-no-wd", base="context.usp", overrides={"cp_ulysses": "2"},
        bug="weight decay dropped by the replica's optimizer")
class USPNoWeightDecay(USPScheme):
    def make_optimizer(self, params):
        return make_buggy_optimizer(params, self.ctx.run, "no-wd")
