"""DistFlashAttn's distributed attention (Li et al. 2023, arXiv 2310.03294): the balanced
causal schedule of ``distflash_plan`` (Sec. 3.1) executed with point-to-point messages whose
next step is posted before the current block is computed and waited after it (Sec. 3.2,
"overlapping key-value communication"), blocks computed by the family's kernels.

Forward, worker r (of P, contiguous chunks): step 0 is its diagonal block (causal); at step
t it receives the K/V of worker r - t (one message of K and V) and attends its own queries
to it, or, as a helper, receives the queries of worker r + P - t, attends them to its own K/V
and sends the partial output and its log-sum-exp back (one message, the log-sum-exp as one
extra column per row); the owner folds it in with the online-softmax merge one step later.

Backward mirrors it (FlashAttention-2's backward needs only each row's final output and
log-sum-exp): at step t the owner of a local block receives the K/V again and sends the
block's dK, dV back to their owner; a helper receives the busy worker's queries, output
gradient, output and log-sum-exp (one message), accumulates dK, dV of its own chunk and sends
the queries' dQ back. No worker keeps another worker's K/V between forward and backward.

Every ordered pair of workers exchanges at most one message of each kind per layer, so the
messages match in posting order without tags (NCCL) as with them (gloo).

Packed documents (``DistFlashPeers.docs``, the micro-batch's over the whole sequence, set by
the scheme for each micro-batch, whose backward runs before the next one's forward): every
block -- the diagonal, a local one, a helped one (the busy worker's queries against the
helper's keys) -- is masked "causal and same document" on the two chunks' global positions
(``documents``); no message changes.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .distflash_plan import BalancedSchedule
from .documents import WHOLE, kernel_args, mask_at, ring_masks
from .kernels import attn_backward, attn_forward, merge

TAG_KV, TAG_Q, TAG_OUT = 31, 32, 33
TAG_BKV, TAG_BQ, TAG_DKV, TAG_DQ = 34, 35, 36, 37


class DistFlashPeers:
    """This worker's view of the cp group: point-to-point messages, the schedule, the merges,
    and counters of the kernel calls and attention forwards it ran (for the row)."""

    #: causal mask on a helped block (it never is: the helper's chunk precedes the queries)
    helped_causal = False
    #: the micro-batch's packed documents over the whole sequence (None: unpacked)
    docs = None

    def __init__(self, group, clock, schedule_class=BalancedSchedule):
        self.group, self.clock = group, clock
        self.size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        self.schedule = schedule_class(self.size)
        self.blocks = 0  # forward kernel calls
        self.forwards = 0  # distributed attention forwards

    def peer(self, i: int) -> int:
        return dist.get_global_rank(self.group, i)

    def isend(self, t: torch.Tensor, dst: int, tag: int):
        return dist.isend(t, dst=self.peer(dst), group=self.group, tag=tag)

    def irecv(self, shape, like: torch.Tensor, src: int, tag: int):
        buf = like.new_empty(shape)
        return buf, dist.irecv(buf, src=self.peer(src), group=self.group, tag=tag)

    def merge(self, out, lse, blk_out, blk_lse) -> None:
        """Fold one of this worker's own blocks into its rows."""
        merge(out, lse, blk_out, blk_lse)

    def merge_remote(self, out, lse, blk_out, blk_lse) -> None:
        """Fold a helper's partial result into the rows (the same online-softmax rule)."""
        merge(out, lse, blk_out, blk_lse)

    def kernel(self, n: int):
        """``kw(src, causal, queries=None)``: the kernel keywords of the block of worker
        ``queries``' (default: this worker's) queries against worker ``src``'s K/V -- the
        documents' mask when packed, else ``causal``."""
        masks = ring_masks(self.docs, self.rank, self.size, n, "none")

        def kw(src: int, causal: bool, queries: int | None = None) -> dict:
            return kernel_args(causal, mask_at(masks, src, WHOLE, WHOLE, queries))
        return kw


def _wait(pending):
    buf, work = pending
    work.wait()
    return buf


def _pack(*parts: torch.Tensor) -> torch.Tensor:
    """Tensors of shape (b, a, n, d_i) or (b, a, n) as one message along the last dim."""
    return torch.cat([p if p.dim() == 4 else p.unsqueeze(-1) for p in parts], -1).contiguous()


def dfa_forward(q, k, v, pe: DistFlashPeers):
    """(output, log-sum-exp) of this worker's (b, a, n, d) queries over the causal sequence."""
    pe.forwards += 1
    P, r = pe.size, pe.rank
    tasks = pe.schedule.tasks(r) if P > 1 else []
    kv = torch.stack([k, v]) if tasks else None
    b, a, n, d = q.shape

    def post(task):
        sends = [pe.isend(kv, task.send_kv, TAG_KV)] if task.send_kv is not None else []
        if task.send_q is not None:
            sends.append(pe.isend(q, task.send_q, TAG_Q))
        recv = None
        if task.local is not None:
            recv = pe.irecv(kv.shape, kv, task.local, TAG_KV)
        elif task.helps is not None:
            recv = pe.irecv(q.shape, q, task.helps, TAG_Q)
        return sends, recv

    pending = post(tasks[0]) if tasks else None
    kw = pe.kernel(n)
    with pe.clock.span("fwd"):
        out, lse = attn_forward(q, k, v, **kw(r, True))
    pe.blocks += 1
    sent, keep, results = [], [], []  # keep: the messages in flight
    for i, task in enumerate(tasks):
        sends, recv = pending
        sent += sends
        x = _wait(recv) if recv is not None else None
        pending = post(tasks[i + 1]) if i + 1 < len(tasks) else None
        if task.helped_by is not None:
            results.append(pe.irecv((b, a, n, d + 1), q, task.helped_by, TAG_OUT))
        with pe.clock.span("fwd"):
            if task.local is not None:
                o, l_ = attn_forward(q, x[0], x[1], **kw(task.local, False))
                pe.merge(out, lse, o, l_)
            elif task.helps is not None:
                o, l_ = attn_forward(x, k, v, **kw(r, pe.helped_causal, task.helps))
        if task.local is not None or task.helps is not None:
            pe.blocks += 1
        if task.helps is not None:
            msg = _pack(o, l_.to(o.dtype))
            sent.append(pe.isend(msg, task.helps, TAG_OUT))
            keep.append(msg)
        # the helpers' results of the previous step, received while this step computed
        while len(results) > (1 if task.helped_by is not None else 0):
            res = _wait(results.pop(0))
            pe.merge_remote(out, lse, res[..., :d], res[..., d])
    for pend in results:
        res = _wait(pend)
        pe.merge_remote(out, lse, res[..., :d], res[..., d])
    for work in sent:
        work.wait()
    return out, lse


def dfa_backward(dout, q, k, v, out, lse, pe: DistFlashPeers):
    """(dq, dk, dv) of this worker's chunk given the rows' final output and log-sum-exp."""
    P, r = pe.size, pe.rank
    dout = dout.contiguous()
    kw = pe.kernel(q.shape[2])
    with pe.clock.span("bwd"):
        dq, dk, dv = attn_backward(dout, q, k, v, out, lse, **kw(r, True))
    tasks = pe.schedule.tasks(r) if P > 1 else []
    if not tasks:
        return dq, dk, dv
    d = q.shape[-1]
    kv = torch.stack([k, v])
    bundle = None
    if any(t.send_q is not None for t in tasks):
        bundle = _pack(q, dout, out, lse.to(q.dtype))

    def post(task):
        sends = [pe.isend(kv, task.send_kv, TAG_BKV)] if task.send_kv is not None else []
        if task.send_q is not None:
            sends.append(pe.isend(bundle, task.send_q, TAG_BQ))
        recv = None
        if task.local is not None:
            recv = pe.irecv(kv.shape, kv, task.local, TAG_BKV)
        elif task.helps is not None:
            recv = pe.irecv(q.shape[:-1] + (3 * d + 1,), q, task.helps, TAG_BQ)
        return sends, recv

    pending = post(tasks[0])
    sent, keep, returns = [], [], []  # keep: the messages in flight
    for i, task in enumerate(tasks):
        sends, recv = pending
        sent += sends
        x = _wait(recv) if recv is not None else None
        pending = post(tasks[i + 1]) if i + 1 < len(tasks) else None
        mine = []  # the gradients of this worker's chunk computed elsewhere at this step
        if task.send_kv is not None:  # worker r + t attends to my K/V: dK, dV come back
            mine.append(("dkv", pe.irecv(kv.shape, kv, task.send_kv, TAG_DKV)))
        if task.helped_by is not None:  # a helper computes a chunk of my queries: dQ back
            mine.append(("dq", pe.irecv(q.shape, q, task.helped_by, TAG_DQ)))
        with pe.clock.span("bwd"):
            block = _block_grads(task, x, kw, r, pe.helped_causal, dout, q, k, v, out, lse,
                                 (dq, dk, dv))
        if block is not None:
            msg, dest, tag = block
            sent.append(pe.isend(msg, dest, tag))
            keep.append(msg)
        _land(returns, dq, dk, dv)
        returns = mine
    _land(returns, dq, dk, dv)
    for work in sent:
        work.wait()
    return dq, dk, dv


def _block_grads(task, x, kw, r: int, helped_causal: bool, dout, q, k, v, out, lse, grads):
    """One backward step's block (``dfa_backward``): a local block adds to dQ and returns
    its dK, dV for their owner; a helped block (``x``: the busy worker's queries, output
    gradient, output and log-sum-exp) adds to dK, dV and returns the queries' dQ. (message,
    destination, tag), or None when the worker idles."""
    dq, dk, dv = grads
    if task.local is not None:
        a, b_, c = attn_backward(dout, q, x[0], x[1], out, lse, **kw(task.local, False))
        dq.add_(a)
        return torch.stack([b_, c]).contiguous(), task.local, TAG_DKV
    if task.helps is None:
        return None
    d = q.shape[-1]
    qo, do, oo, lo = x[..., :d], x[..., d:2 * d], x[..., 2 * d:3 * d], x[..., 3 * d]
    msg, b_, c = attn_backward(do, qo, k, v, oo, lo.float(), **kw(r, helped_causal, task.helps))
    dk.add_(b_)
    dv.add_(c)
    return msg.contiguous(), task.helps, TAG_DQ


def _land(returns, dq, dk, dv) -> None:
    for kind, pend in returns:
        g = _wait(pend)
        if kind == "dkv":
            dk.add_(g[0])
            dv.add_(g[1])
        else:
            dq.add_(g)


class DistFlashAttention(torch.autograd.Function):
    """Causal attention of this worker's (b, a, n, d) queries (``dfa_forward`` /
    ``dfa_backward``); saves q, k, v, the output and the log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v, pe):
        out, lse = dfa_forward(q, k, v, pe)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.pe = pe
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        return (*dfa_backward(dout, q, k, v, out, lse, ctx.pe), None)


class ReplayAttention(torch.autograd.Function):
    """The attention of a rematerialised layer (Sec. 3.3): forward returns the output saved
    at the checkpoint -- no kernel, no message -- and backward is ``dfa_backward`` on the
    recomputed q, k, v with that output and log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v, out, lse, pe):
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.pe = pe
        return out.clone()

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        return (*dfa_backward(dout, q, k, v, out, lse, ctx.pe), None, None, None)


class DistFlashCore:
    """q, k, v (b, n, heads, d) of this worker's contiguous tokens -> (b, n, h)."""

    attention = DistFlashAttention

    def __init__(self, peers: DistFlashPeers):
        self.peers = peers

    @staticmethod
    def heads_major(q, k, v):
        return tuple(t.transpose(1, 2).contiguous() for t in (q, k, v))

    @staticmethod
    def tokens_major(out):
        b, a, n, d = out.shape
        return out.transpose(1, 2).reshape(b, n, a * d)

    def keep(self, blk, x, out, lse):
        """What a rematerialised layer saves at its checkpoint (``distflash_remat``)."""
        return x, out, lse

    def kept(self, blk, saved):
        """The checkpoint's tensors, back in its backward."""
        return tuple(saved)

    def __call__(self, q, k, v):
        q, k, v = self.heads_major(q, k, v)
        return self.tokens_major(self.attention.apply(q, k, v, self.peers))
