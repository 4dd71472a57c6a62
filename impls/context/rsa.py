"""Ring Self-Attention (Li et al. 2021, "Sequence Parallelism: Long Sequence Training from
System Perspective", Sec. 3.2), causal, on contiguous sequence shards.

Forward: the key blocks travel the ring (N - 1 sends) so that each rank forms its query rows'
full score matrix (n x s per head), masked causally on *global* positions and soft-maxed;
then the value blocks travel the ring (N - 1 sends) and each rank sums P_j V_j. The score
rows are kept for backward (RSA stores them; its memory grows with s^2/N).

Backward, as in the authors' reference implementation (ColossalAI's ``RingAV`` and
``RingQK``, by the paper's authors): dV of the whole sequence (P^T dO, a partial sum over
this rank's queries) is all-reduced over the ring and each rank keeps its block; dP needs
every V block again (N - 1 sends); dK of the whole sequence (dS^T Q) is all-reduced likewise;
dQ needs every K block again (N - 1 sends).

Grouped-query attention (Ainslie et al. 2023): K and V hold g = num_kv_heads heads, each
serving a/g consecutive query heads (query head i reads K/V head i // (a/g)). The K and V
blocks travel the ring at those g heads (b n h_kv, h_kv = g head_dim); each query head's
score rows are formed against its group's K block and its output from the group's V blocks
(``_grouped``). In backward a K/V head's gradient is the sum over its query group, taken on
the rank before the all-reduce, so dV and dK of the whole sequence are all-reduced at the
K/V heads' width (b s h_kv each).

Packed documents (``RingPeers.docs``): the score rows are masked "causal and same document"
on global positions (``parbench.model.packing.allowed``) before the softmax; every row keeps
its own token, and the backward works on the saved probabilities, which hold the mask.
"""
from __future__ import annotations

import math

import torch

from parbench.model.packing import allowed

from .kernels import fold_group, query_group
from .ring import RingPeers

TAG_K = 11
TAG_V = 12


def _blocks(t: torch.Tensor, size: int):
    """Column blocks (one per source rank) of a (b, h, n, size*n) score-shaped tensor."""
    n = t.shape[-1] // size
    return [t[..., i * n:(i + 1) * n] for i in range(size)]


def _ring(ring: RingPeers, local: torch.Tensor, tag: int, use) -> None:
    """Pass ``local`` around the ring; ``use(src, block)`` for every block (own first)."""
    cur = local
    for j in range(ring.size):
        pending = ring.exchange(cur, tag) if j < ring.size - 1 else None
        use((ring.rank - j) % ring.size, cur)
        if pending is not None:
            cur = pending.wait()


def _grouped(a: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """``a @ kv`` per query group: ``a`` (b, heads, x, y) of the query heads, ``kv``
    (b, kv heads, y, z) of the K/V heads (GQA: kv heads divide heads, query head i against
    K/V head i // (heads / kv heads)) -> (b, heads, x, z); a plain matmul without groups."""
    g = query_group(a, kv)
    if g == 1:
        return a @ kv
    return (a.unflatten(1, (kv.shape[1], g)) @ kv.unsqueeze(2)).flatten(1, 2)


def _may_attend(docs, rank: int, n: int, size: int, device) -> torch.Tensor:
    """(n, size n) "key not later", or with packed ``docs`` (b, 1, n, size n) "and in the
    same document", for rank ``rank``'s contiguous rows."""
    qpos = torch.arange(rank * n, (rank + 1) * n, device=device)
    kpos = torch.arange(size * n, device=device)
    if docs is None:
        return kpos[None, :] <= qpos[:, None]
    ids = docs.ids.to(device)
    return allowed(ids[:, qpos], ids, qpos, kpos)


class RingSelfAttention(torch.autograd.Function):
    """Causal attention of this rank's contiguous (b, heads, n, d) queries over the ring's
    (b, kv heads, n, d) keys and values (kv heads dividing heads: grouped-query attention)."""

    @staticmethod
    def forward(ctx, q, k, v, ring: RingPeers):
        b, heads, n, d = q.shape
        size, rank = ring.size, ring.rank
        scale = 1.0 / math.sqrt(d)
        scores = q.new_empty(b, heads, n, size * n)
        cols = _blocks(scores, size)

        def qk(src, kb):
            with ring.clock.span("fwd"):
                cols[src].copy_(_grouped(q, kb.transpose(-1, -2))).mul_(scale)

        _ring(ring, k, TAG_K, qk)
        scores.masked_fill_(~_may_attend(ring.docs, rank, n, size, q.device), float("-inf"))
        p = torch.softmax(scores, dim=-1)
        scores = cols = None  # the score rows live on as p
        out = torch.zeros_like(q)
        probs = _blocks(p, size)

        def av(src, vb):
            with ring.clock.span("fwd"):
                out.add_(_grouped(probs[src], vb))

        _ring(ring, v, TAG_V, av)
        ctx.save_for_backward(q, k, v, p)
        ctx.ring = ring
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, p = ctx.saved_tensors
        ring = ctx.ring
        size, rank, n = ring.size, ring.rank, q.shape[2]
        g = query_group(q, k)
        scale = 1.0 / math.sqrt(q.shape[-1])
        dout = dout.contiguous()
        # dV: this rank's queries' share for the whole sequence (each K/V head's summed over
        # its query group), summed over the ring
        with ring.clock.span("bwd"):
            dv_all = fold_group(p.transpose(-1, -2) @ dout, g)
        dv = ring.sum_over_ring(dv_all)[:, :, rank * n:(rank + 1) * n].clone()
        del dv_all
        dp = torch.empty_like(p)
        dcols = _blocks(dp, size)

        def dpv(src, vb):
            with ring.clock.span("bwd"):
                dcols[src].copy_(_grouped(dout, vb.transpose(-1, -2)))

        _ring(ring, v, TAG_V, dpv)
        with ring.clock.span("bwd"):
            ds = p * (dp - (dp * p).sum(-1, keepdim=True))
            ds.mul_(scale)
            dk_all = fold_group(ds.transpose(-1, -2) @ q, g)
        dp = dcols = None
        dk = ring.sum_over_ring(dk_all)[:, :, rank * n:(rank + 1) * n].clone()
        del dk_all
        dq = torch.zeros_like(q)
        dsb = _blocks(ds, size)

        def dqk(src, kb):
            with ring.clock.span("bwd"):
                dq.add_(_grouped(dsb[src], kb))

        _ring(ring, k, TAG_K, dqk)
        return dq, dk, dv, None


class RSACore:
    """q (b, n, heads, d), k, v (b, n, kv heads, d) of this rank's contiguous tokens ->
    (b, n, h)."""

    attention = RingSelfAttention
    #: masks packed documents (``ring.docs``: the micro-batch's over the whole sequence)
    supports_packing = True
    docs = None

    def __init__(self, ring: RingPeers):
        self.ring = ring

    def __call__(self, q, k, v, docs=None):
        b, n, heads, d = q.shape
        docs = self.docs if docs is None else docs
        ring = self.ring if docs is None else self.ring.with_documents(docs)
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        out = self.attention.apply(q, k, v, ring)
        return out.transpose(1, 2).reshape(b, n, heads * d)
