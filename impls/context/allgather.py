"""All-gather context parallelism (Llama 3, Dubey et al. 2024, Sec. 3.3.2; the "SP" row of the
UB-Mesh traffic table): each rank all-gathers K and V of the whole sequence and attends with
its own queries, masked causally on global positions (any layout: the gathered keys keep
their owners' order and their positions say which a query may see).

The gathered K and V are not kept for backward (TransformerEngine's all-gather CP does the
same): backward gathers them again, computes dQ and the full-sequence dK, dV, and
reduce-scatters dK and dV to their owners. Per layer: 2 all-gathers forward, 2 all-gathers
and 2 reduce-scatters backward, each of b s h elements.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from parbench.model.packing import allowed

from .kernels import attn_backward, attn_forward


class GatherGroup:
    """The cp group, this rank's index in it, every rank's token positions and the clock."""

    def __init__(self, group, positions: list[torch.Tensor], clock):
        self.group = group
        self.size = len(positions)
        self.rank = dist.get_rank(group) if self.size > 1 else 0
        self.positions = [tuple(int(x) for x in p) for p in positions]
        self.clock = clock
        #: the micro-batch's packed documents over the whole sequence (None: unpacked)
        self.docs = None

    def mask(self, device) -> torch.Tensor:
        """(n, s) "may attend": key position <= query position; with packed ``docs``,
        (b, 1, n, s): and in the same document (``parbench.model.packing.allowed``)."""
        q = torch.tensor(self.positions[self.rank], device=device)
        k = torch.tensor([x for p in self.positions for x in p], device=device)
        if self.docs is not None:
            return allowed(self.docs.ids[:, q], self.docs.ids[:, k], q, k)
        return k[None, :] <= q[:, None]


def _gather(t: torch.Tensor, g: GatherGroup) -> torch.Tensor:
    """(b, h, n, d) -> (b, h, size*n, d), blocks in rank order."""
    if g.size == 1:
        return t
    flat = torch.empty(g.size * t.numel(), dtype=t.dtype, device=t.device)
    dist.all_gather_into_tensor(flat, t.contiguous().view(-1), group=g.group)
    b, h, n, d = t.shape
    return flat.view(g.size, b, h, n, d).permute(1, 2, 0, 3, 4).reshape(b, h, g.size * n, d)


def _reduce_scatter(t: torch.Tensor, g: GatherGroup) -> torch.Tensor:
    """(b, h, size*n, d) summed over the group -> this rank's (b, h, n, d) block."""
    if g.size == 1:
        return t
    b, h, sn, d = t.shape
    n = sn // g.size
    full = t.view(b, h, g.size, n, d).permute(2, 0, 1, 3, 4).contiguous()
    out = torch.empty(b, h, n, d, dtype=t.dtype, device=t.device)
    dist.reduce_scatter_tensor(out.view(-1), full.view(-1), group=g.group)
    return out


class AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g: GatherGroup):
        kf, vf = _gather(k, g), _gather(v, g)
        with g.clock.span("fwd"):
            out, lse = attn_forward(q, kf, vf, mask=g.mask(q.device))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.g = g
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        g = ctx.g
        kf, vf = _gather(k, g), _gather(v, g)
        with g.clock.span("bwd"):
            dq, dkf, dvf = attn_backward(dout, q, kf, vf, out, lse, mask=g.mask(q.device))
        del kf, vf
        return dq, _reduce_scatter(dkf, g), _reduce_scatter(dvf, g), None


class AllGatherCore:
    """q, k, v (b, n, heads, d) -> (b, n, h)."""

    def __init__(self, g: GatherGroup):
        self.g = g

    def __call__(self, q, k, v):
        b, n, heads, d = q.shape
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        out = AllGatherAttention.apply(q, k, v, self.g)
        return out.transpose(1, 2).reshape(b, n, heads * d)
