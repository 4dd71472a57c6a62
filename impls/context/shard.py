"""The reference GPT run on a sequence shard, with a pluggable attention core.

The same modules and weights as ``parbench.model`` (so parameter names match the golden run),
layer by layer, with two changes: the learned position embeddings added are those of the
rank's own tokens (``pos``: their global positions, from ``layout``), and the attention core
-- softmax(Q K^T / sqrt(d)) V, causal -- is a distributed one, called with the rank's
(b, n, heads, d) Q, K, V and returning its (b, n, h) output. The native schemes and the
baselines share it; they differ in the core and in how gradients are reduced.

``recompute``: ``full`` checkpoints every layer (reentrant: autograd keeps the layer input),
``selective`` the attention core (Korthikanti et al. 2022, Sec. 5); either re-runs the core,
and its communication, in backward.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def embed(model, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Token embeddings plus the learned position embeddings of *these* tokens."""
    e = model.embed
    x = e.tok(tokens)
    return x if e.pos is None else x + e.pos.weight[pos]


def layer(blk, x: torch.Tensor, core, recompute: str = "none", docs=None) -> torch.Tensor:
    """One pre-LN block (``parbench.model.Block``) with ``core`` as its attention;
    ``docs``: the rank's tokens' positions for RoPE (``attention_inputs``)."""
    if recompute == "full":
        return checkpoint(_layer, blk, x, core, "none", docs, use_reentrant=True)
    return _layer(blk, x, core, recompute, docs)


def attention_inputs(blk, x: torch.Tensor, docs=None):
    """q (b, n, heads, d) and k, v (b, n, kv heads, d) of the rank's tokens: the reference
    projection and ``Attention.heads`` with K/V left at their own heads (grouped-query
    attention: the cores move num_kv_heads of them; the kernel serves each query group);
    with ``docs`` (``parbench.model.packing.Documents`` of these tokens: their global
    positions, or within-document ones when packed) RoPE at those positions, not at 0..n-1,
    the classic bug of a context-parallel chunk."""
    qkv = blk.attn.qkv(blk.ln1(x))
    return tuple(t.transpose(1, 2) for t in blk.attn.heads(qkv, docs, expand=False))


def _layer(blk, x, core, recompute, docs=None):
    q, k, v = attention_inputs(blk, x, docs)
    if recompute == "selective":
        y = checkpoint(core, q, k, v, use_reentrant=True)
    else:
        y = core(q, k, v)
    x = x + blk.attn.proj(y)
    return x + blk.mlp(blk.ln2(x))


def summed_loss(model, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The reference head's cross-entropy summed over the counted targets (those not
    ``IGNORE_INDEX`` add nothing): a rank's part of a masked loss, whose mean over its own
    tokens could be 0/0 (a shard of masked prompts only)."""
    head = model.head
    logits = head.out(head.ln(x))
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           reduction="sum")


def mean_loss(model, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The reference head's mean token loss."""
    return model.head(x, targets)


def shard_forward(model, tokens, pos, targets, core, recompute: str = "none",
                  first_layer=None, embed_fn=embed, loss_fn=mean_loss,
                  docs=None) -> torch.Tensor:
    """The loss of this rank's tokens (``loss_fn``: their mean, or ``summed_loss``);
    ``first_layer`` (a context manager, e.g. ``SavedActivations``) is entered around
    layer 0; ``docs``: the tokens' positions for RoPE and packed documents (``layer``)."""
    x = embed_fn(model, tokens, pos if docs is None else docs.pos)
    for i, blk in enumerate(model.blocks.values()):
        if first_layer is not None and i == 0:
            with first_layer:
                x = layer(blk, x, core, recompute, docs)
        else:
            x = layer(blk, x, core, recompute, docs)
    return loss_fn(model, x, targets)


class ShardedGPT(torch.nn.Module):
    """A module around ``shard_forward`` for engines that wrap a module (DeepSpeed, DDP):
    ``forward(tokens, pos, targets)``; parameters are ``gpt.<reference name>``."""

    def __init__(self, gpt, core, recompute: str = "none"):
        super().__init__()
        self.gpt = gpt
        self.core = core
        self.recompute = recompute

    def forward(self, tokens, pos, targets):
        return shard_forward(self.gpt, tokens, pos, targets, self.core, self.recompute)
