"""Collectives as autograd functions: the conjugate operators of Megatron tensor parallelism.

Shoeybi et al. 2019 (Sec. 3, Fig. 3) name two conjugate operators around a parallel region:
``f`` is the identity in forward and an all-reduce in backward (before a column-parallel
linear), ``g`` an all-reduce in forward and the identity in backward (after a row-parallel
linear). Korthikanti et al. 2022 (Sec. 4.2.2, Fig. 5) replace them under sequence parallelism
by ``g`` = all-gather along the sequence in forward / reduce-scatter in backward and ``g-bar``
= reduce-scatter in forward / all-gather in backward.

Tensors are laid out sequence-first, ``[s, b, ...]`` (as Megatron lays them out), so a
sequence shard is a contiguous block along dim 0 and the gathers and scatters below move flat
contiguous buffers (gloo gathers into 1-D outputs only: ``../shared/CPU-NOTES.md``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def all_gather_dim0(x: torch.Tensor, group, size: int) -> torch.Tensor:
    """Concatenate every rank's ``x`` along dim 0 (one all-gather of a flat buffer)."""
    x = x.contiguous()
    out = torch.empty(size * x.numel(), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, x.view(-1), group=group)
    return out.view(size * x.shape[0], *x.shape[1:])


def reduce_scatter_dim0(x: torch.Tensor, group, size: int) -> torch.Tensor:
    """Sum ``x`` over the ranks and keep this rank's block of dim 0 (one reduce-scatter)."""
    x = x.contiguous()
    out = torch.empty(x.numel() // size, dtype=x.dtype, device=x.device)
    dist.reduce_scatter_tensor(out, x.view(-1), group=group)
    return out.view(x.shape[0] // size, *x.shape[1:])


class CopyToRegion(torch.autograd.Function):
    """``f``: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromRegion(torch.autograd.Function):
    """``g``: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ReduceScatterToSequence(torch.autograd.Function):
    """``g-bar``: reduce-scatter along the sequence (dim 0) forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, group, size):
        ctx.group, ctx.size = group, size
        return reduce_scatter_dim0(x, group, size)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim0(grad, ctx.group, ctx.size), None, None


class GatherFromSequence(torch.autograd.Function):
    """``g``: all-gather along the sequence forward, reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x, group, size):
        ctx.group, ctx.size = group, size
        return all_gather_dim0(x, group, size)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_dim0(grad, ctx.group, ctx.size), None, None


class GatherLastDim(torch.autograd.Function):
    """All-gather along the last dimension forward, reduce-scatter along it backward
    (Megatron-Core's ``all_gather_last_dim_from_tensor_parallel_region``): moved to dim 0 so
    that one flat buffer travels each way."""

    @staticmethod
    def forward(ctx, x, group, size):
        ctx.group, ctx.size = group, size
        return all_gather_dim0(x.movedim(-1, 0), group, size).movedim(0, -1)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_dim0(grad.movedim(-1, 0), ctx.group, ctx.size).movedim(0, -1), \
            None, None


class AllReduceSum(torch.autograd.Function):
    """A sum over the group whose every rank consumes the result (LayerNorm statistics of a
    hidden dimension split over ranks): all-reduce forward, all-reduce of the gradient
    backward (d/dx_r of sum_q x_q used on every rank q is the sum of their gradients)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def all_reduce_flat(tensors: list[torch.Tensor], group) -> None:
    """Sum ``tensors`` over ``group`` in place with one all-reduce of their concatenation
    (Megatron-Core's bucketed reduction of the sequence-parallel parameters' gradients)."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
