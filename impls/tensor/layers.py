"""Megatron's parallel layers as autograd functions (Shoeybi et al. 2019, Sec. 3; Korthikanti
et al. 2022, Sec. 4.2.2), on sequence-first activations ``[s, b, h]``.

- :class:`ColumnParallelLinear`: ``f`` fused with a linear whose output features are split
  over the tp ranks. Backward all-reduces the input gradient asynchronously while the weight
  gradient is computed (Megatron's ``async_tensor_model_parallel_allreduce``). With sequence
  parallelism the input is this rank's sequence shard: forward all-gathers it; the shard,
  not the gathered input, is saved for backward, which all-gathers it again for the weight
  gradient and reduce-scatters the input gradient (Korthikanti et al. Sec. 4.2.2: "we store
  only Y_i^s ... and perform an extra all-gather in the backward pass").
- :class:`RowParallelLinear`: a linear whose input features are split, fused with ``g``
  (all-reduce) or, with sequence parallelism, ``g-bar`` (reduce-scatter along the sequence);
  its bias is added by the caller after the reduction, once.
- :func:`vocab_parallel_embedding` and :class:`VocabParallelCrossEntropy`: the vocabulary
  split over the ranks; the loss needs three all-reduces of one value per token (max logit,
  target logit, sum of exponentials).
- :class:`Recompute`: run a function without saving its activations and run it again in
  backward (activation recomputation, Chen et al. 2016; Korthikanti et al. Sec. 5).

Under a split backward (zero-bubble schedules, ``impls.common.backward_pass``) the two linears do
only the pass's part: B the input gradient and its collective, W the weight gradient (the
column linear re-gathers its sequence shard in W; the row linear keeps B's gathered gradient
for W), so a split step moves the bytes of a fused one.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from impls.common import backward_pass

from .collectives import all_gather_dim0, reduce_scatter_dim0  # noqa: F401


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


class ColumnParallelLinear(torch.autograd.Function):
    """y = x W^T + b with W's rows (output features) split; ``sp_size`` > 1: x is the
    sequence shard and is all-gathered first."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, sp_size):
        ctx.group, ctx.sp_size, ctx.has_bias = group, sp_size, bias is not None
        ctx.save_for_backward(x, weight)
        full = all_gather_dim0(x, group, sp_size) if sp_size > 1 else x
        out = torch.matmul(full, weight.t())
        if bias is not None:
            out = out + bias
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        part = backward_pass.current()
        if part == backward_pass.WEIGHT:  # W of a split backward: the weight part only
            full = _gather_async(x, ctx)[1]() if ctx.sp_size > 1 else x
            return None, *_weight_grads(grad, full, ctx.has_bias), None, None
        sp = ctx.sp_size > 1
        gather = None
        if sp and part is None:
            # re-gather the input shard while the input gradient is computed (Megatron's
            # overlap of the backward all-gather with the dgrad GEMM)
            gather = _gather_async(x, ctx)
        grad_in = torch.matmul(grad, weight).contiguous()
        if sp:
            # reduce-scatter overlapped with the weight gradient
            out = torch.empty(grad_in.numel() // ctx.sp_size, dtype=grad_in.dtype,
                              device=grad_in.device)
            work = dist.reduce_scatter_tensor(out, grad_in.view(-1), group=ctx.group,
                                              async_op=True)
            result = out.view(grad_in.shape[0] // ctx.sp_size, *grad_in.shape[1:])
        else:
            result = grad_in
            work = dist.all_reduce(result, group=ctx.group, async_op=True)
        grads = (None, None)
        if part is None:  # fused: the weight gradient while the collective runs
            grads = _weight_grads(grad, gather[1]() if sp else x, ctx.has_bias)
        work.wait()
        return result, *grads, None, None


def _gather_async(x: torch.Tensor, ctx):
    """Start the all-gather of the sequence shard ``x``; (work, wait -> gathered input)."""
    xc = x.contiguous()
    flat = torch.empty(ctx.sp_size * xc.numel(), dtype=x.dtype, device=x.device)
    work = dist.all_gather_into_tensor(flat, xc.view(-1), group=ctx.group, async_op=True)

    def wait() -> torch.Tensor:
        work.wait()
        return flat.view(ctx.sp_size * x.shape[0], *x.shape[1:])
    return work, wait


def _weight_grads(grad: torch.Tensor, x: torch.Tensor, has_bias: bool):
    """(dW, db) of y = x W^T + b."""
    return (torch.matmul(_flat(grad).t(), _flat(x)),
            _flat(grad).sum(0) if has_bias else None)


class RowParallelLinear(torch.autograd.Function):
    """y = sum over ranks of x_r W_r^T (input features split), all-reduced (``g``) or, with
    ``sp_size`` > 1, reduce-scattered along the sequence (``g-bar``); no bias."""

    @staticmethod
    def forward(ctx, x, weight, group, sp_size):
        ctx.group, ctx.sp_size = group, sp_size
        ctx.save_for_backward(x, weight)
        out = torch.matmul(x, weight.t())
        if sp_size > 1:
            return reduce_scatter_dim0(out, group, sp_size)
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        part = backward_pass.current()
        if ctx.sp_size > 1:
            # B keeps the gathered gradient for W (one all-gather per backward either way)
            kept = getattr(ctx, "gathered", None) if part == backward_pass.WEIGHT else None
            grad = kept if kept is not None else all_gather_dim0(grad, ctx.group, ctx.sp_size)
            ctx.gathered = grad if part == backward_pass.INPUT else None
        grad_in = None if part == backward_pass.WEIGHT else torch.matmul(grad, weight)
        grad_w = None if part == backward_pass.INPUT else \
            torch.matmul(_flat(grad).t(), _flat(x))
        return grad_in, grad_w, None, None


def vocab_parallel_embedding(tokens: torch.Tensor, weight: torch.Tensor, start: int
                             ) -> torch.Tensor:
    """This rank's partial embedding: rows of tokens in [start, start + rows), zeros for the
    others (the sum over ranks is the lookup; Shoeybi et al. Sec. 3, input embedding)."""
    rows = weight.shape[0]
    outside = (tokens < start) | (tokens >= start + rows)
    local = (tokens - start).masked_fill(outside, 0)
    out = torch.nn.functional.embedding(local, weight)
    return out.masked_fill(outside.unsqueeze(-1), 0.0)


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of logits split along the vocabulary (this rank's columns
    ``[start, start + V_local)``), as Megatron computes it: all-reduce the max logit, the
    target logit and the sum of exponentials (three all-reduces of one fp32 value per token).
    Saves the local softmax for backward: d loss / d logits = softmax - onehot(target)."""

    @staticmethod
    def forward(ctx, logits, target, start, group):
        logits = logits.float()
        lmax = logits.max(dim=-1).values
        dist.all_reduce(lmax, op=dist.ReduceOp.MAX, group=group)
        z = logits - lmax.unsqueeze(-1)
        vl = logits.shape[-1]
        outside = (target < start) | (target >= start + vl)
        idx = (target - start).masked_fill(outside, 0)
        pred = z.gather(-1, idx.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        dist.all_reduce(pred, group=group)
        ez = z.exp()
        sum_exp = ez.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        loss = sum_exp.log() - pred
        ez.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(ez, idx, outside)
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, idx, outside = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(-1, idx.unsqueeze(-1), -(~outside).to(g.dtype).unsqueeze(-1))
        g.mul_(grad.unsqueeze(-1))
        return g, None, None, None


class Recompute(torch.autograd.Function):
    """``Recompute.apply(fn, *inputs)``: ``fn(*inputs)`` without keeping its activations;
    only the inputs are saved, and backward runs ``fn`` again (with its collectives) and
    back-propagates through it. Parameters used by ``fn`` receive their gradients inside."""

    @staticmethod
    def forward(ctx, fn, *inputs):
        ctx.fn = fn
        ctx.save_for_backward(*inputs)
        with torch.no_grad():
            return fn(*inputs)

    @staticmethod
    def backward(ctx, *grads):
        inputs = [x.detach().requires_grad_(x.requires_grad) for x in ctx.saved_tensors]
        with torch.enable_grad():
            out = ctx.fn(*inputs)
        outs = out if isinstance(out, tuple) else (out,)
        with backward_pass.running(None):  # the inner backward is a whole one
            torch.autograd.backward(outs, grads)
        ctx.fn = None
        return (None, *[x.grad if x.requires_grad else None for x in inputs])
