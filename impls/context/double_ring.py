"""LoongTrain's Double-Ring-Attention (Gu et al. 2024, "LoongTrain: Efficient Training of
Long-Sequence LLMs with Head-Context Parallelism", arXiv 2406.18485, Sec. 4, Double-Ring-
Attention): the context-parallel ring of c ranks is cut into c/w *windows* (inner rings) of w
consecutive ring ranks; ring rank R = W w + j sits in window W at inner index j.

Forward, on rank (W, j): outer step t = 0 .. c/w - 1 works on the K/V blocks of window
W - t. The block that *entered* the window at this rank (its own at t = 0) goes round the
inner ring (w - 1 sends, one K/V message each), every rank attending to it as it passes;
meanwhile the entry block is forwarded once over the outer ring to (W + 1, j), where it
enters the next window at the next outer step (c/w - 1 sends) -- the outer transfer is
hidden behind w inner steps instead of one. Over the step a rank has seen every one of the
c blocks exactly once, as in a single ring of c, with c - 1 K/V sends in all.

Backward: K/V blocks travel the same two rings again. A block's dK/dV accumulator follows
the single ring's rule on each level: inside a window it starts on the rank after the entry
rank and reaches the entry rank with the (w-1)-th hop, which adds its own contribution --
the window's total for the block; across windows it starts in the window after the block's
owner, picks up each window's total at the entry rank and reaches the owner with the
(c/w - 1)-th outer hop. c - 1 dK/dV sends in all, as the single ring.

Causal masks and the zig-zag / striped load balancing (``ring.block_plan``) are decided on
*global* ring ranks: the block's source is ring rank ((W - t) mod c/w) w + (j - s) mod w at
inner step s. w = 1 (every hop outer) and w = c (one window) are the single ring.

Packed documents (``DoubleRingPeers.docs``) mask every block "causal and same document" on
the global positions of the query and the K/V block's ring ranks (``documents``), as the
single ring does.
"""
from __future__ import annotations

import torch

from .documents import kernel_args, mask_at
from .kernels import attn_backward, attn_forward, merge
from .ring import TAG_DKV, TAG_KV, RingBlocks, RingPeers, _rows, restore_ring, save_ring

TAG_KV_OUTER = 17
TAG_DKV_OUTER = 18


class DoubleRingPeers(RingBlocks):
    """This rank's place on the double ring: the inner ring (window) and outer ring peers
    (``RingPeers``, or ones of size 1), the global ring rank and the layout; the blocks'
    plan, documents and landing as a single ring's (``RingBlocks``)."""

    def __init__(self, inner: RingPeers, outer: RingPeers, clock, balance: str = "none"):
        self.inner, self.outer, self.clock, self.balance = inner, outer, clock, balance
        self.w, self.windows = inner.size, outer.size
        self.size = self.w * self.windows
        self.rank = self.ring_rank(outer.rank, inner.rank)

    def ring_rank(self, window: int, inner: int) -> int:
        return window * self.w + inner

    def source(self, t: int, s: int) -> int:
        """Ring rank whose block this rank holds at outer step t, inner step s."""
        return self.ring_rank((self.outer.rank - t) % self.windows,
                              (self.inner.rank - s) % self.w)

    def forward_entry(self, entry: torch.Tensor, t: int):
        """Start the outer hop of the block that entered this window at step t (the hop
        carries it to the next window for step t + 1); None after the last step."""
        return self.outer.exchange(entry, TAG_KV_OUTER) if t < self.windows - 1 else None

    def calls(self, src: int, n: int, masks):
        """(query rows, key rows, kernel keywords) of this rank's calls against ring rank
        ``src``'s block: the block plan, each call masked by the documents when packed."""
        return [(qs, ks, kernel_args(causal, mask_at(masks, src, qs, ks)))
                for qs, ks, causal in self.plan(src, n)]


def _attend(q, kv, out, lse, calls):
    for qs, ks, kw in calls:
        o, lb = attn_forward(_rows(q, qs), _rows(kv[0], ks), _rows(kv[1], ks), **kw)
        if out is None:  # the diagonal block (every row, causal) starts the running result
            out, lse = o, lb
        else:
            merge(_rows(out, qs), _rows(lse, qs), o, lb)
    return out, lse


def _grad(dout, q, kv, out, lse, dq, calls):
    """This rank's dK/dV contribution to one block (None: masked out); dQ added in place."""
    if not calls:
        return None
    blk = torch.zeros_like(kv)
    for qs, ks, kw in calls:
        a, b_, c = attn_backward(_rows(dout, qs), _rows(q, qs), _rows(kv[0], ks),
                                 _rows(kv[1], ks), _rows(out, qs), _rows(lse, qs), **kw)
        _rows(dq, qs).add_(a)
        _rows(blk[0], ks).add_(b_)
        _rows(blk[1], ks).add_(c)
    return blk


class DoubleRingAttention(torch.autograd.Function):
    """Causal attention of this rank's (b, h, n, d) queries over the double ring's keys."""

    @staticmethod
    def forward(ctx, q, k, v, ring: DoubleRingPeers):
        n, inner, w = q.shape[2], ring.inner, ring.w
        masks = ring.masks(n)
        entry = torch.stack([k, v])
        out = lse = None
        for t in range(ring.windows):
            outer_hop = ring.forward_entry(entry, t)
            cur, pending = entry, inner.exchange(entry, TAG_KV) if w > 1 else None
            for s in range(w):
                if s:
                    cur = pending.wait()
                    pending = inner.exchange(cur, TAG_KV) if s < w - 1 else None
                with ring.clock.span("fwd"):
                    out, lse = _attend(q, cur, out, lse, ring.calls(ring.source(t, s), n, masks))
            if outer_hop is not None:
                entry = outer_hop.wait()
        return save_ring(ctx, ring, q, k, v, out, lse)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, ring, masks, dout = restore_ring(ctx, dout)
        n, inner, outer, w = q.shape[2], ring.inner, ring.outer, ring.w
        dq = torch.zeros_like(q)
        entry = torch.stack([k, v])
        own = None
        sends = []
        for t in range(ring.windows):
            # the accumulator of this window's entry block from the window before (t >= 2),
            # posted before the K/V hop: messages between two ranks are matched in the order
            # the sender sent them (NCCL ignores tags)
            arriving = outer.recv_prev(entry, TAG_DKV_OUTER) if t >= 2 else None
            outer_hop = ring.forward_entry(entry, t)
            cur, pending = entry, inner.exchange(entry, TAG_KV) if w > 1 else None
            with ring.clock.span("bwd"):
                kept = _grad(dout, q, entry, out, lse, dq, ring.calls(ring.source(t, 0), n, masks))
            for s in range(1, w):
                cur = pending.wait()
                incoming = inner.recv_prev(cur, TAG_DKV) if s >= 2 else None  # (same order)
                pending = inner.exchange(cur, TAG_KV) if s < w - 1 else None
                with ring.clock.span("bwd"):
                    blk = _grad(dout, q, cur, out, lse, dq,
                                ring.calls(ring.source(t, s), n, masks))
                if incoming is not None:
                    buf, work = incoming
                    work.wait()
                    blk = buf if blk is None else blk.add_(buf)
                if blk is None:
                    blk = torch.zeros_like(cur)
                sends.append((inner.send_next(blk, TAG_DKV), blk))
            total = torch.zeros_like(entry) if kept is None else kept
            if w > 1:  # the window's accumulator of the entry block, back at the entry rank
                buf, work = inner.recv_prev(entry, TAG_DKV)
                work.wait()
                total = ring.land(total, buf)
            if t == 0:
                own = total
            else:
                if arriving is not None:
                    buf, work = arriving
                    work.wait()
                    total = total.add_(buf)
                sends.append((outer.send_next(total, TAG_DKV_OUTER), total))
            if outer_hop is not None:
                entry = outer_hop.wait()
        if ring.windows > 1:  # the owner's block gradient from every other window
            buf, work = outer.recv_prev(own, TAG_DKV_OUTER)
            work.wait()
            own = ring.land(own, buf)
        for work, _ in sends:
            work.wait()
        return dq, own[0], own[1], None
