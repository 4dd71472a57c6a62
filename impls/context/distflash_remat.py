"""Rematerialization-aware gradient checkpointing (Li et al. 2023, DISTFLASHATTN, Sec. 3.3).

Checkpointing a layer at its input (HuggingFace's and Megatron's ``full`` recomputation, and
``shard.layer``) re-runs the whole layer in backward -- the distributed attention forward
included, with all of its communication -- although FlashAttention's backward needs only
q, k, v, the output and each row's log-sum-exp. DistFlashAttn moves the checkpoint boundary
to the attention output: the layer keeps its input *and* the attention's output and
log-sum-exp; backward recomputes the cheap local parts (LayerNorm, QKV projection; output
projection, MLP) and runs the distributed attention backward directly on the saved output
(``ReplayAttention``), so the attention forward runs once per layer and micro-batch and its
messages are not sent again. Memory kept per layer: x (b n h), the output (b n h) and the
log-sum-exp (b a n) instead of x alone -- the paper's trade for skipping one attention
forward per layer in backward.

``RematLayer`` is a reentrant checkpoint (its backward runs autograd on the recomputed graph
and returns the input's gradient; the parameters receive theirs directly), so it composes
with the family's flat gradient buffer as ``torch.utils.checkpoint`` does.
"""
from __future__ import annotations

import torch

from .distflash_attn import ReplayAttention, dfa_forward
from .shard import embed, mean_loss


def qkv(blk, x: torch.Tensor):
    """The layer's q, k, v (b, a, n, d), heads-major, as ``shard._layer`` computes them."""
    b, n, h = x.shape
    heads = blk.attn.num_heads
    q, k, v = blk.attn.qkv(blk.ln1(x)).view(b, n, 3, heads, h // heads).unbind(2)
    return tuple(t.transpose(1, 2).contiguous() for t in (q, k, v))


def after_attention(blk, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Output projection, residual and MLP of the layer, given the attention output
    (b, a, n, d)."""
    b, a, n, d = out.shape
    x = x + blk.attn.proj(out.transpose(1, 2).reshape(b, n, a * d))
    return x + blk.mlp(blk.ln2(x))


class RematLayer(torch.autograd.Function):
    """One pre-LN layer checkpointed at its input and its attention output."""

    @staticmethod
    def forward(ctx, x, blk, core):
        with torch.no_grad():
            q, k, v = qkv(blk, x)
            out, lse = dfa_forward(q, k, v, core.peers)
            y = after_attention(blk, x, out)
        ctx.blk, ctx.core = blk, core
        ctx.save_for_backward(*core.keep(blk, x, out, lse))
        return y

    @staticmethod
    def backward(ctx, dy):
        x, out, lse = ctx.core.kept(ctx.blk, ctx.saved_tensors)
        with torch.enable_grad():
            x = x.detach().requires_grad_(True)
            q, k, v = qkv(ctx.blk, x)
            o = ReplayAttention.apply(q, k, v, out, lse, ctx.core.peers)
            y = after_attention(ctx.blk, x, o)
        torch.autograd.backward(y, dy)
        return x.grad, None, None


def remat_shard_forward(model, tokens, pos, targets, core, first_layer=None,
                        embed_fn=embed, loss_fn=mean_loss, docs=None) -> torch.Tensor:
    """``shard.shard_forward`` with every layer a ``RematLayer`` (``docs``: the tokens'
    within-document positions when packed)."""
    x = embed_fn(model, tokens, pos if docs is None else docs.pos)
    for i, blk in enumerate(model.blocks.values()):
        if first_layer is not None and i == 0:
            with first_layer:
                x = RematLayer.apply(x, blk, core)
        else:
            x = RematLayer.apply(x, blk, core)
    return loss_fn(model, x, targets)
