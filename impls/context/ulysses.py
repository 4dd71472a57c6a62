"""DeepSpeed-Ulysses (Jacobs et al. 2023, Sec. 3.1-3.2) and USP (Fang & Zhao 2024, "USP: A
Unified Sequence Parallelism Approach for Long Context Generative AI", Sec. 3).

Ulysses: before attention an all-to-all turns each rank's (its s/P tokens, all heads) Q, K
and V into (all s tokens, its heads/P); attention runs locally over the whole sequence for
those heads; a fourth all-to-all turns the output back into (s/P tokens, all heads). The
backward of each all-to-all is the inverse all-to-all: 4 forward, 4 backward per layer, one
rank's buffer b (s/P) h each. Heads must divide by P.

USP: the cp ranks form a u x r grid; Ulysses runs inside each u-group (heads / u per rank,
the u-group's tokens gathered), and ring attention (``ring.RingAttention``) runs over the
r-groups on those gathered tokens. u = cp is Ulysses, u = 1 is ring attention.

Packed documents (``pack_docs``): after the all-to-all a rank holds its u-group's tokens in
order -- the whole sequence under Ulysses, the ring rank's tokens under USP -- so the core
hands the micro-batch's documents over the *whole* sequence (never a rank's shard of them)
to the ring, which masks each block "causal and same document" on global positions
(``ring``, ``documents``); a ring of one masks the gathered sequence against itself.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .ring import RingAttention, RingPeers


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def seq_to_heads(x: torch.Tensor, group, u: int) -> torch.Tensor:
    """(b, n, heads, d) of this rank's tokens -> (b, heads/u, u n, d) of the group's tokens
    (in group-rank order) for this rank's heads."""
    b, n, heads, d = x.shape
    send = x.reshape(b, n, u, heads // u, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = _all_to_all(send, group)  # recv[j]: rank j's tokens, my heads
    return recv.permute(1, 3, 0, 2, 4).reshape(b, heads // u, u * n, d)


def heads_to_seq(y: torch.Tensor, group, u: int) -> torch.Tensor:
    """The inverse: (b, heads/u, u n, d) -> (b, n, heads, d)."""
    b, hu, un, d = y.shape
    n = un // u
    send = y.reshape(b, hu, u, n, d).permute(2, 0, 3, 1, 4).contiguous()
    recv = _all_to_all(send, group)  # recv[j]: head group j of my tokens
    return recv.permute(1, 2, 0, 3, 4).reshape(b, n, u * hu, d)


class SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, u):
        ctx.group, ctx.u = group, u
        return seq_to_heads(x, group, u)

    @staticmethod
    def backward(ctx, g):
        return heads_to_seq(g, ctx.group, ctx.u), None, None


class HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group, u):
        ctx.group, ctx.u = group, u
        return heads_to_seq(y, group, u)

    @staticmethod
    def backward(ctx, g):
        return seq_to_heads(g, ctx.group, ctx.u), None, None


class UlyssesRingCore:
    """q, k, v (b, n, heads, d) of this rank's tokens -> attention output (b, n, h).

    ``ulysses`` is the all-to-all group (None: no Ulysses level) of ``u`` ranks; ``ring`` the
    ring over which the (gathered) tokens are spread (a ring of one: local attention).
    ``docs``: the micro-batch's packed documents over the whole sequence (the scheme sets
    them per micro-batch), or the ``docs`` of one call (bound to that call's ring)."""

    attention = RingAttention
    seq_to_heads = SeqToHeads
    heads_to_seq = HeadsToSeq
    #: masks packed documents (module docstring)
    supports_packing = True
    docs = None

    def __init__(self, ulysses, u: int, ring: RingPeers):
        self.ulysses, self.u, self.ring = ulysses, u, ring

    def ring_for(self, docs=None):
        """The ring of one call: bound to its documents when packed."""
        docs = self.docs if docs is None else docs
        return self.ring if docs is None else self.ring.with_documents(docs)

    def __call__(self, q, k, v, docs=None):
        b, n, heads, d = q.shape
        ring = self.ring_for(docs)
        if self.ulysses is None:
            q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
            out = self.attention.apply(q, k, v, ring)
            return out.transpose(1, 2).reshape(b, n, heads * d)
        q, k, v = (self.seq_to_heads.apply(t, self.ulysses, self.u) for t in (q, k, v))
        out = self.attention.apply(q, k, v, ring)
        return self.heads_to_seq.apply(out, self.ulysses, self.u).reshape(b, n, heads * d)
