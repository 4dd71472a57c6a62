"""Ring Attention (Liu et al. 2023, "Ring Attention with Blockwise Transformers for
Near-Infinite Context", Sec. 3, Algorithm 1), causal, with the three layouts of ``layout``.

Forward: each rank keeps its query block and passes its key/value block (one message of K
and V) around the ring; at step j it attends to the block of rank (r - j) mod N while the
next block is in flight, and folds the block's output into its rows with the online-softmax
merge (``kernels.merge``). N - 1 sends per layer.

Backward: the K/V blocks travel the ring again (N - 1 sends); each step's dQ stays on the
rank, while the block's dK/dV accumulator travels *with* the block: it starts on the rank
after the block's owner (the owner keeps its own contribution), is added to on every rank
the block visits and reaches the owner with the last hop -- N - 1 sends, not N. Gradients of
every block use the rows' final output and log-sum-exp (FlashAttention-2's backward).

Causal masking is decided per block from the *global* positions of the two blocks
(``block_plan``): with the contiguous layout (``none``) blocks from later ranks are skipped,
so rank N-1 computes N blocks and rank 0 one; zig-zag and striped layouts give every rank the
same work. K/V messages and dK/dV messages use separate tags and are posted in the same
order on every rank (NCCL ignores tags; on gloo a hop is a collective, ``RingPeers``): the
backward interleaves them, each dK/dV hop one ``exchange`` like a K/V hop.

Packed documents (``RingPeers.docs``, the micro-batch's over the whole sequence): every
planned kernel call is masked "causal and same document" on the two blocks' global positions
(``documents``), forward and backward; a call's ring is bound to its documents
(``RingPeers.with_documents``) and kept by the autograd node, so the backward masks with the
forward's documents.
"""
from __future__ import annotations

import copy
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .documents import kernel_args, mask_at, ring_masks
from .kernels import attn_backward, attn_forward, merge

TAG_KV = 7
TAG_DKV = 8

Slice = tuple[int, int]


def block_plan(balance: str, rank: int, src: int, n: int
               ) -> list[tuple[Slice, Slice, bool]]:
    """The kernel calls for this rank's queries against the K/V block of ring rank ``src``:
    (query rows, key rows, causal) with rows as [start, stop); [] when the causal mask hides
    the whole block.

    - ``none``: src == rank causal, src < rank full, src > rank nothing;
    - ``zigzag`` (chunks rank, 2N-1-rank of size n/2): src == rank causal; src < rank: every
      query against the source's first chunk; src > rank: the second query chunk against the
      whole block;
    - ``striped`` (token t on rank t mod N): src <= rank causal with the diagonal, src > rank
      strictly lower: queries 1.. against keys ..n-1, causal.
    """
    full = (0, n)
    if src == rank:
        return [(full, full, True)]
    if balance == "none":
        return [(full, full, False)] if src < rank else []
    if balance == "zigzag":
        half = n // 2
        return [(full, (0, half), False)] if src < rank else [((half, n), full, False)]
    if balance == "striped":
        if src < rank:
            return [(full, full, True)]
        return [((1, n), (0, n - 1), True)] if n > 1 else []
    raise ValueError(f"cp_balance={balance!r} must be none, zigzag or striped")


def _rows(t: torch.Tensor, sl: Slice) -> torch.Tensor:
    return t[:, :, sl[0]:sl[1]]


@dataclass
class AttentionClock:
    """CPU seconds (and wall seconds) this rank spent in attention kernels, per step; each
    span also goes to the timeline as ``attn``. Floats only: nothing here is a tensor."""

    timeline: object = None
    cpu: float = 0.0
    wall: float = 0.0
    per_step: list = field(default_factory=list)

    @contextmanager
    def span(self, what: str):
        c0, w0 = time.thread_time(), time.perf_counter()
        if self.timeline is not None:
            with self.timeline.span("attn", what=what):
                yield
        else:
            yield
        self.cpu += time.thread_time() - c0
        self.wall += time.perf_counter() - w0

    def end_step(self, step: int) -> None:
        self.per_step.append((step, self.cpu, self.wall))
        self.cpu = self.wall = 0.0


class RingBlocks:
    """What a ring and a double ring do alike with the ``size`` blocks of a sequence, this
    rank holding block ``rank`` under load ``balance``: the kernel calls against a block, the
    packed documents' masks of the blocks, and a travelled gradient landing at its owner."""

    #: the micro-batch's packed documents over the whole sequence (None: unpacked)
    docs = None

    def plan(self, src: int, n: int) -> list[tuple[Slice, Slice, bool]]:
        """The kernel calls against the block of ring rank ``src`` (``block_plan``)."""
        return block_plan(self.balance, self.rank, src, n)

    def with_documents(self, docs):
        """This ring masking packed ``docs`` (a copy: a call binds its own documents)."""
        out = copy.copy(self)
        out.docs = docs
        return out

    def masks(self, n: int):
        """The document masks of the ring's blocks of ``n`` tokens (None: unpacked)."""
        return ring_masks(self.docs, self.rank, self.size, n, self.balance)

    def land(self, own: torch.Tensor, returned: torch.Tensor) -> torch.Tensor:
        """The owner's block gradient: its own contribution plus the accumulator that
        travelled the ring."""
        return own.add_(returned)


class RingPeers(RingBlocks):
    """This rank's neighbours on a ring (a process group, or none for a ring of one).

    One hop (``exchange``: send to the next rank, receive from the previous one) is a pair of
    point-to-point messages, or -- on gloo (``hop_by_all_to_all``) -- one ``all_to_all_single``
    whose only non-empty splits are the next rank's (out) and the previous rank's (in): the
    same bytes on the wire and one call, as a send. Issue 24 measured why: on gloo a hop by
    isend/irecv took a median 3.3 ms on a 2-core machine (2 ranks, a 16 KiB K/V block), the
    same hop as an all-to-all 0.24 ms. Every rank of a ring hops alike, so the collective's
    order is the same on every rank."""

    def __init__(self, group, clock: AttentionClock, balance: str = "none"):
        self.group = group
        self.clock = clock
        self.balance = balance
        self.hop_by_all_to_all = False
        if group is None:
            self.size, self.rank = 1, 0
            return
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)
        self.hop_by_all_to_all = dist.get_backend(group) == "gloo"

    def merge(self, out, lse, blk_out, blk_lse) -> None:
        """Fold a block's result into the rows (``kernels.merge``)."""
        merge(out, lse, blk_out, blk_lse)

    def attend(self, q, k, v, causal: bool, mask=None):
        """(output, log-sum-exp) of one block: the document ``mask`` or the ``causal``
        flag (``documents.kernel_args``)."""
        return attn_forward(q, k, v, **kernel_args(causal, mask))

    def sum_over_ring(self, t: torch.Tensor) -> torch.Tensor:
        """Partial sums of every rank, summed in place (an all-reduce over the ring)."""
        if self.size > 1:
            dist.all_reduce(t, group=self.group)
        return t

    def send_next(self, t: torch.Tensor, tag: int):
        return dist.isend(t, dst=self.next, group=self.group, tag=tag)

    def recv_prev(self, like: torch.Tensor, tag: int):
        buf = torch.empty_like(like)
        return buf, dist.irecv(buf, src=self.prev, group=self.group, tag=tag)

    def exchange(self, t: torch.Tensor, tag: int):
        """Send ``t`` to the next rank and receive the previous rank's into a new buffer;
        returns a handle whose ``wait()`` gives the received tensor (class docstring)."""
        if self.hop_by_all_to_all:
            return self._hop(t)
        buf, rwork = self.recv_prev(t, tag)
        swork = self.send_next(t, tag)
        return _Exchange(buf, rwork, swork, t)

    def hop_peers(self) -> tuple[int, int]:
        """The group ranks an all-to-all hop sends to and receives from: next, previous."""
        return (self.rank + 1) % self.size, (self.rank - 1) % self.size

    def _hop(self, t: torch.Tensor):
        """One hop as an all-to-all: ``t`` (whole, along dim 0) to the next ring rank only,
        the previous ring rank's into the new buffer."""
        t = t.contiguous()
        buf = torch.empty_like(t)
        to, frm = self.hop_peers()
        out_splits, in_splits = [0] * self.size, [0] * self.size
        in_splits[to] = t.shape[0]
        out_splits[frm] = t.shape[0]
        work = dist.all_to_all_single(buf, t, out_splits, in_splits, group=self.group,
                                      async_op=True)
        return _Exchange(buf, work, None, t)


class _Exchange:
    def __init__(self, buf, rwork, swork, sent):
        self.buf, self.rwork, self.swork, self.sent = buf, rwork, swork, sent

    def wait(self) -> torch.Tensor:
        self.rwork.wait()
        if self.swork is not None:
            self.swork.wait()
        self.sent = None
        return self.buf


def save_ring(ctx, ring, q, k, v, out, lse) -> torch.Tensor:
    """The forward's end (ring and double ring alike): what the backward needs kept on
    ``ctx``; returns ``out``."""
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.ring = ring
    return out


def restore_ring(ctx, dout):
    """The backward's start: (q, k, v, out, lse, ring, the forward's document masks,
    contiguous ``dout``); the ring is bound to its call's documents."""
    q, k, v, out, lse = ctx.saved_tensors
    ring = ctx.ring
    return q, k, v, out, lse, ring, ring.masks(q.shape[2]), dout.contiguous()


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's (b, h, n, d) queries over the whole ring's keys.

    Step 0 is the rank's own, diagonal block: causal, every row, so its kernel's output and
    log-sum-exp start the running result (and its dK, dV the owner's block gradient); the
    other steps follow ``ring.plan`` and ``ring.merge``. A ring of one is local attention."""

    @staticmethod
    def forward(ctx, q, k, v, ring: RingPeers):
        n, size, rank = q.shape[2], ring.size, ring.rank
        masks = ring.masks(n)
        kv = torch.stack([k, v]) if size > 1 else None
        pending = ring.exchange(kv, TAG_KV) if size > 1 else None
        with ring.clock.span("fwd"):
            out, lse = ring.attend(q, k, v, True, mask_at(masks, rank, (0, n), (0, n)))
        for j in range(1, size):
            kv = pending.wait()
            pending = ring.exchange(kv, TAG_KV) if j < size - 1 else None
            src = (rank - j) % size
            with ring.clock.span("fwd"):
                for qs, ks, causal in ring.plan(src, n):
                    o, lse_b = ring.attend(_rows(q, qs), _rows(kv[0], ks), _rows(kv[1], ks),
                                           causal, mask_at(masks, src, qs, ks))
                    ring.merge(_rows(out, qs), _rows(lse, qs), o, lse_b)
        if pending is not None:
            pending.wait()
        return save_ring(ctx, ring, q, k, v, out, lse)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, ring, masks, dout = restore_ring(ctx, dout)
        n, size, rank = q.shape[2], ring.size, ring.rank
        kv = torch.stack([k, v]) if size > 1 else None
        pending = ring.exchange(kv, TAG_KV) if size > 1 else None
        with ring.clock.span("bwd"):
            dq, dk, dv = attn_backward(dout, q, k, v, out, lse,
                                       **kernel_args(True, mask_at(masks, rank, (0, n), (0, n))))
        if size == 1:
            return dq, dk, dv, None
        arriving = None  # the accumulator of the next step's block, from the rank before
        for j in range(1, size):
            kv = pending.wait()
            pending = ring.exchange(kv, TAG_KV) if j < size - 1 else None
            src = (rank - j) % size
            with ring.clock.span("bwd"):
                blk = _block_grads(ring, dq, dout, q, kv, out, lse, masks, src, n)
            if arriving is not None:
                buf = arriving.wait()
                blk = buf if blk is None else blk.add_(buf)
            # one hop: this block's accumulator to the next rank; in, the one for step j + 1
            # (after the last step: the own block's, returned). Posted after the step's K/V
            # hop on every rank: NCCL matches a pair's messages by order, not by tag
            arriving = ring.exchange(torch.zeros_like(kv) if blk is None else blk, TAG_DKV)
        own = ring.land(torch.stack([dk, dv]), arriving.wait())
        return dq, own[0], own[1], None


def _block_grads(ring, dq, dout, q, kv, out, lse, masks, src: int, n: int):
    """The kernel calls' gradients against the K/V block ``kv`` of ring rank ``src``: dQ
    added to ``dq`` in place; the block's dK, dV (stacked as ``kv``; None when the plan
    skips the block)."""
    plan = ring.plan(src, n)
    if not plan:
        return None
    blk = torch.zeros_like(kv)
    for qs, ks, causal in plan:
        a, b_, c = attn_backward(_rows(dout, qs), _rows(q, qs), _rows(kv[0], ks),
                                 _rows(kv[1], ks), _rows(out, qs), _rows(lse, qs),
                                 **kernel_args(causal, mask_at(masks, src, qs, ks)))
        _rows(dq, qs).add_(a)
        _rows(blk[0], ks).add_(b_)
        _rows(blk[1], ks).add_(c)
    return blk
