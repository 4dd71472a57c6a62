"""The reference model's layer, LM head and embedding as one tensor-parallel rank holds them
(widths divided by tp, heads a/tp; ``parbench.model``'s operators in its order: pre-norm, QKV,
rotary positions where the model has no learned ones, fused causal attention, projection,
residual, norm, MLP, residual), at a model shape's variants (grouped-query attention, gated
MLP, RMSNorm, RoPE, no biases): what calibration times."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..model.blocks import rotate
from .plan import gated_mlp, kv_width

#: RoPE's base for the layers of a model without learned positions: any base costs the same
#: (the reference model's ``rotate``, run on q and k)
ROPE_THETA = 10000.0


def _norm(shape, h: int) -> nn.Module:
    rms = getattr(shape, "norm", "layernorm") == "rmsnorm"
    return nn.RMSNorm(h) if rms and hasattr(nn, "RMSNorm") else nn.LayerNorm(h)


def vocab_shard(shape, tp: int) -> int:
    """The padded vocabulary rows one tensor-parallel rank holds."""
    return -(-shape.V // tp)


class LocalLayer(nn.Module):
    def __init__(self, shape, tp: int):
        super().__init__()
        h, f = shape.h, shape.f // tp
        self.h, self.d = h, h // shape.a
        self.heads = shape.a // tp
        self.kv = kv_width(shape) // tp
        self.kv_heads = max(1, self.kv // self.d)
        self.gated = gated_mlp(shape)
        self.rope = not getattr(shape, "position_embeddings", True)
        bias = bool(getattr(shape, "bias", True))
        self.ln1, self.ln2 = _norm(shape, h), _norm(shape, h)
        self.qkv = nn.Linear(h, self.heads * self.d + 2 * self.kv, bias=bias)
        self.proj = nn.Linear(self.heads * self.d, h, bias=bias)
        self.fc1 = nn.Linear(h, f * (2 if self.gated else 1), bias=bias)
        self.fc2 = nn.Linear(f, h, bias=bias)

    def forward(self, x):
        b, s, _ = x.shape
        d, heads, kv_heads = self.d, self.heads, self.kv_heads
        q, k, v = self.qkv(self.ln1(x)).split([heads * d, self.kv, self.kv], dim=-1)
        q = q.view(b, s, heads, d).transpose(1, 2)
        k = k.view(b, s, kv_heads, d).transpose(1, 2)
        v = v.view(b, s, kv_heads, d).transpose(1, 2)
        if self.rope:  # a model without learned positions rotates q and k (RoPE)
            pos = torch.arange(s, device=x.device)
            q, k = rotate(q, pos, ROPE_THETA), rotate(k, pos, ROPE_THETA)
        if kv_heads != heads:
            k = k.repeat_interleave(heads // kv_heads, 1)
            v = v.repeat_interleave(heads // kv_heads, 1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, heads * d))
        z = self.fc1(self.ln2(x))
        if self.gated:
            g_, u = z.chunk(2, dim=-1)
            z = F.silu(g_) * u
        else:
            z = F.gelu(z)
        return x + self.fc2(z)


class LocalHead(nn.Module):
    def __init__(self, shape, tp: int):
        super().__init__()
        self.vl = vocab_shard(shape, tp)
        self.ln = _norm(shape, shape.h)
        self.out = nn.Linear(shape.h, self.vl, bias=False)

    def forward(self, x, targets):
        logits = self.out(self.ln(x))
        return F.cross_entropy(logits.float().reshape(-1, self.vl), targets.reshape(-1))


class LocalEmbed(nn.Module):
    def __init__(self, shape, tp: int):
        super().__init__()
        self.tok = nn.Embedding(vocab_shard(shape, tp), shape.h)
        self.pos = nn.Embedding(shape.s, shape.h) if getattr(shape, "position_embeddings",
                                                             True) else None

    def forward(self, tokens):
        x = self.tok(tokens)
        if self.pos is not None:
            x = x + self.pos.weight[: tokens.shape[1]]
        return x


def local_modules(shape, tp: int, dtype):
    """(layer, head, embedding) of one tensor-parallel rank of ``shape``, in ``dtype``."""
    return (LocalLayer(shape, tp).to(dtype), LocalHead(shape, tp).to(dtype),
            LocalEmbed(shape, tp).to(dtype))
