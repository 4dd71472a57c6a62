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

Probe points (issue 20, sec. 5; ``parbench.probes``): the attention here is not the reference
``Attention`` module (its core is distributed) and the embedding and the loss are functions,
so ``taps`` -- reference module name -> :class:`Tap`, installed only when a failing case is
localised -- wraps each reference part (``embed``, ``blocks.i.ln1`` / ``attn`` / ``ln2`` /
``mlp``, ``head``) in a module whose hooks see the part's input and output as the reference
module's would. A tap fires only while autograd records: under full recomputation a layer's
first, graph-less forward is not a call of its probe, its recomputation in backward is.
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


class Tap(torch.nn.Module):
    """``tap(x, fn, *args)`` is ``fn(x, *args)``: a module whose hooks see ``x`` and the
    result (no parameter, no state)."""

    def forward(self, x, fn, *args):
        return fn(x, *args)


def tapped(taps: dict | None, name: str, fn, x, *args):
    """``fn(x, *args)``, through ``taps[name]`` when installed and autograd records."""
    tap = taps.get(name) if taps else None
    if tap is None or not torch.is_grad_enabled():
        return fn(x, *args)
    return tap(x, fn, *args)


def layer(blk, x: torch.Tensor, core, recompute: str = "none", docs=None, taps=None,
          name: str = "blocks.0") -> torch.Tensor:
    """One pre-LN block (``parbench.model.Block``) with ``core`` as its attention;
    ``docs``: the rank's tokens' positions for RoPE (``attention_inputs``); ``taps``: the
    probe points of reference block ``name`` (module docstring)."""
    if recompute == "full":
        return checkpoint(_layer, blk, x, core, "none", docs, taps, name, use_reentrant=True)
    return _layer(blk, x, core, recompute, docs, taps, name)


def attention_inputs(blk, x: torch.Tensor, docs=None):
    """q (b, n, heads, d) and k, v (b, n, kv heads, d) of the rank's tokens: the reference
    projection and ``Attention.heads`` with K/V left at their own heads (grouped-query
    attention: the cores move num_kv_heads of them; the kernel serves each query group);
    with ``docs`` (``parbench.model.packing.Documents`` of these tokens: their global
    positions, or within-document ones when packed) RoPE at those positions, not at 0..n-1,
    the classic bug of a context-parallel chunk."""
    return _projected(blk, blk.ln1(x), docs)


def _projected(blk, a: torch.Tensor, docs=None):
    """q, k, v of the normed input ``a`` (``attention_inputs``)."""
    qkv = blk.attn.qkv(a)
    return tuple(t.transpose(1, 2) for t in blk.attn.heads(qkv, docs, expand=False))


def _attention(a, blk, core, recompute, docs=None):
    """The reference ``Attention`` of the normed input ``a`` with ``core`` as its kernel."""
    q, k, v = _projected(blk, a, docs)
    if recompute == "selective":
        y = checkpoint(core, q, k, v, use_reentrant=True)
    else:
        y = core(q, k, v)
    return blk.attn.proj(y)


def _layer(blk, x, core, recompute, docs=None, taps=None, name="blocks.0"):
    a = tapped(taps, f"{name}.ln1", blk.ln1, x)
    x = x + tapped(taps, f"{name}.attn", _attention, a, blk, core, recompute, docs)
    h = tapped(taps, f"{name}.ln2", blk.ln2, x)
    return x + tapped(taps, f"{name}.mlp", blk.mlp, h)


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
                  docs=None, taps=None, layer_fn=layer) -> torch.Tensor:
    """The loss of this rank's tokens (``loss_fn``: their mean, or ``summed_loss``);
    ``first_layer`` (a context manager, e.g. ``SavedActivations``) is entered around
    layer 0; ``docs``: the tokens' positions for RoPE and packed documents (``layer``);
    ``taps``: probe points (module docstring); ``layer_fn``: one layer, with ``layer``'s
    signature."""
    at = pos if docs is None else docs.pos
    x = tapped(taps, "embed", lambda t: embed_fn(model, t, at), tokens)
    for i, (key, blk) in enumerate(model.blocks.items()):
        if first_layer is not None and i == 0:
            with first_layer:
                x = layer_fn(blk, x, core, recompute, docs, taps, f"blocks.{key}")
        else:
            x = layer_fn(blk, x, core, recompute, docs, taps, f"blocks.{key}")
    return tapped(taps, "head", lambda h: loss_fn(model, h, targets), x)


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
