"""One pipeline stage's forward over one token slice, with the K/V cache of earlier slices.

Seq1F1B (Sun et al. 2024, arXiv 2406.03488, Sec. 3) and TeraPipe (Li et al. 2021, arXiv
2102.07988, Sec. 3) run a stage on slice j of a sequence (tokens ``offset ..
offset + l - 1``) after slices 0..j-1: every position-wise part (embedding, layer norms,
projections, MLP, head) sees only the slice, and causal attention lets the slice's queries
read the keys and values of every earlier token -- the K/V the earlier slices computed on
this stage (the cache), and the slice's own.

How the gradient flows (the reason for the leaves): the cache enters slice j's attention as
leaf tensors that share the storage of the earlier slices' K/V (``detach().requires_grad_``),
so the backward of slice j stops at them and returns their gradients; the executor adds
those into the K/V gradients of the earlier slices and hands them to each earlier slice's
backward as extra output gradients (its K and V are outputs of its graph beside the stage
output). Each slice's backward thus runs once, last slice first, as the schedules order it.

The attention of a slice is one autograd function (:class:`CachedAttention`) that saves its
inputs only -- the slice's q, k, v and the cached K/V, views of the qkv projections' outputs
the tracker counts once -- and recomputes the attention in its backward, so no concatenated
copy of the cache is kept between a forward and its backward (the paper's implementation
likewise keeps one K/V cache per micro-batch). The loss of the last stage is the slice's
token mean weighted by ``l / s``: the slices' losses add up to the sequence's token mean.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


def causal_attention(q, k, v, cached_k, cached_v, offset: int, shift: int = 0):
    """Attention of the queries at positions ``offset ..`` over the cached keys (positions
    0 .. offset-1, in slice order) and the slice's own; ``shift`` moves the query positions
    (0 is right; the self-test's mutant sets 1)."""
    if not cached_k and not shift:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    keys = torch.cat([*cached_k, k], dim=2)
    values = torch.cat([*cached_v, v], dim=2)
    length, total = q.shape[2], keys.shape[2]
    if total != offset + length:
        raise ValueError(f"slice at offset={offset} of length {length} has {total} keys "
                         f"(cache of {total - length} tokens)")
    query_pos = torch.arange(offset + shift, offset + shift + length, device=q.device)
    allowed = torch.arange(total, device=q.device)[None, :] <= query_pos[:, None]
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed)


class CachedAttention(torch.autograd.Function):
    """``causal_attention`` as one node: saves q, k, v and the cache; recomputes in backward."""

    @staticmethod
    def forward(ctx, q, k, v, offset, shift, n_cached, *cached):
        ctx.offset, ctx.shift, ctx.n_cached = offset, shift, n_cached
        ctx.save_for_backward(q, k, v, *cached)
        return causal_attention(q, k, v, list(cached[:n_cached]), list(cached[n_cached:]),
                                offset, shift)

    @staticmethod
    def backward(ctx, grad):
        saved = ctx.saved_tensors
        inputs = [t.detach().requires_grad_(True) for t in saved]
        n = ctx.n_cached
        with torch.enable_grad():
            out = causal_attention(inputs[0], inputs[1], inputs[2], inputs[3:3 + n],
                                   inputs[3 + n:], ctx.offset, ctx.shift)
        wanted = [i for i, t in enumerate(saved) if ctx.needs_input_grad[i if i < 3 else i + 3]]
        grads = torch.autograd.grad(out, [inputs[i] for i in wanted], grad)
        result = [None] * len(saved)
        for i, g in zip(wanted, grads):
            result[i] = g
        return (*result[:3], None, None, None, *result[3:])


@dataclass
class SliceOutput:
    """What the forward of one slice on one stage leaves: the stage output (the weighted loss
    on the last stage), this slice's K/V per layer (outputs of its graph, cached for later
    slices) and the cache leaves it read, per layer: ``[(k_i, v_i) for earlier slices i]``."""

    out: torch.Tensor
    own: list[tuple[torch.Tensor, torch.Tensor]]
    leaves: list[list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=list)


class SliceForward:
    """Runs a ``parbench.model.GPTStage`` on one token slice (the mutants override a part)."""

    #: query-position shift of the causal mask (0; a mutant's off-by-one sets 1)
    mask_shift = 0

    def cache_leaf(self, t: torch.Tensor) -> torch.Tensor:
        """The cached K or V as this slice reads it: a leaf on the same storage whose
        gradient the executor hands back to the slice that made it."""
        return t.detach().requires_grad_(True)

    def visible_cache(self, cache: list[tuple]) -> list[tuple]:
        """The earlier slices' (K, V) this slice's attention reads (all of them)."""
        return cache

    def loss_weight(self, length: int, seq_length: int) -> float:
        """The slice loss's share of the sequence's token-mean loss."""
        return length / seq_length

    def attention(self, attn, x, cache):
        """Causal attention of the slice over the cache it sees; returns (output, its K/V)."""
        b, length, hidden = x.shape
        heads = attn.num_heads
        q, k, v = attn.qkv(x).view(b, length, 3, heads, hidden // heads).unbind(2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        seen = self.visible_cache(cache)
        ks, vs = [ck for ck, _ in seen], [cv for _, cv in seen]
        offset = sum(ck.shape[2] for ck in ks)  # the slice's first position in the keys
        y = CachedAttention.apply(q, k, v, offset, self.mask_shift, len(ks), *ks, *vs)
        return attn.proj(y.transpose(1, 2).reshape(b, length, hidden)), (k, v)

    def __call__(self, module, x, targets, *, offset: int, seq_length: int,
                 cached: list[list[tuple]]) -> SliceOutput:
        """``cached[layer]``: the (K, V) of the earlier slices on this stage, in order."""
        h = x
        if module.embed is not None:
            h = module.embed.tok(x)
            if module.embed.pos is not None:
                h = h + module.embed.pos.weight[offset:offset + x.shape[1]]
        own, leaves = [], []
        for layer, block in enumerate(module.blocks.values()):
            cache = [(self.cache_leaf(k), self.cache_leaf(v)) for k, v in cached[layer]]
            a, kv = self.attention(block.attn, block.ln1(h), cache)
            h = h + a
            h = h + block.mlp(block.ln2(h))
            own.append(kv)
            leaves.append(cache)
        if module.head is not None:
            h = module.head(h, targets) * self.loss_weight(x.shape[1], seq_length)
        return SliceOutput(h, own, leaves)
