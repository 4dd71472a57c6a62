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
from .shard import embed, mean_loss, shard_forward, tapped


def qkv(blk, a: torch.Tensor, docs=None):
    """q, k, v (b, a, n, d), heads-major, of the layer's normed input ``a``, as
    ``shard._projected`` computes them: the reference ``Attention.heads``, RoPE at the
    tokens' global (or within-document) positions ``docs`` when the model rotates."""
    return tuple(t.contiguous() for t in blk.attn.heads(blk.attn.qkv(a), docs, expand=False))


def projected(blk, out: torch.Tensor) -> torch.Tensor:
    """The output projection of the attention output (b, a, n, d)."""
    b, a, n, d = out.shape
    return blk.attn.proj(out.transpose(1, 2).reshape(b, n, a * d))


def replayed(a: torch.Tensor, blk, out, lse, peers, docs=None) -> torch.Tensor:
    """The layer's attention (the reference ``Attention`` of the normed input ``a``) in
    backward: ``ReplayAttention`` on the recomputed q, k, v and the saved output."""
    return projected(blk, ReplayAttention.apply(*qkv(blk, a, docs), out, lse, peers))


def after_attention(blk, x: torch.Tensor, attn: torch.Tensor, taps=None,
                    name: str = "blocks.0") -> torch.Tensor:
    """Residual and MLP of the layer, given its projected attention output ``attn``
    (``taps``: the probe points of block ``name``, ``shard``)."""
    x = x + attn
    h = tapped(taps, f"{name}.ln2", blk.ln2, x)
    return x + tapped(taps, f"{name}.mlp", blk.mlp, h)


class RematLayer(torch.autograd.Function):
    """One pre-LN layer checkpointed at its input and its attention output; its probe
    points (``taps``, block ``name``) fire in backward's recomputation, the attention's
    output being the saved one."""

    @staticmethod
    def forward(ctx, x, blk, core, taps=None, name="blocks.0", docs=None):
        with torch.no_grad():
            out, lse = dfa_forward(*qkv(blk, blk.ln1(x), docs), core.peers)
            y = after_attention(blk, x, projected(blk, out))
        ctx.blk, ctx.core, ctx.taps, ctx.name, ctx.docs = blk, core, taps, name, docs
        ctx.save_for_backward(*core.keep(blk, x, out, lse))
        return y

    @staticmethod
    def backward(ctx, dy):
        blk, taps, name = ctx.blk, ctx.taps, ctx.name
        x, out, lse = ctx.core.kept(blk, ctx.saved_tensors)
        with torch.enable_grad():
            x = x.detach().requires_grad_(True)
            a = tapped(taps, f"{name}.ln1", blk.ln1, x)
            o = tapped(taps, f"{name}.attn", replayed, a, blk, out, lse, ctx.core.peers,
                       ctx.docs)
            y = after_attention(blk, x, o, taps, name)
        torch.autograd.backward(y, dy)
        return x.grad, None, None, None, None, None


def remat_layer(blk, x, core, recompute="full", docs=None, taps=None, name="blocks.0"):
    """``shard.layer``'s signature for a ``RematLayer`` (the core masks packed documents
    itself, its peers bound to them; ``docs`` give RoPE its positions)."""
    return RematLayer.apply(x, blk, core, taps, name, docs)


def remat_shard_forward(model, tokens, pos, targets, core, first_layer=None,
                        embed_fn=embed, loss_fn=mean_loss, docs=None, taps=None
                        ) -> torch.Tensor:
    """``shard.shard_forward`` with every layer a ``RematLayer`` (``docs``: the tokens'
    within-document positions when packed; ``taps``: probe points)."""
    return shard_forward(model, tokens, pos, targets, core, "full", first_layer, embed_fn,
                         loss_fn, docs, taps, layer_fn=remat_layer)
