"""The dense blocks of the reference decoder: token (and learned position) embeddings,
causal attention (within documents when sequences are packed: ``packing``), the MLP and the
head (final norm, LM head, mean token cross-entropy).

GPT-2 style by default (Radford et al. 2019): learned positions, LayerNorm, GELU MLP
h -> 4h -> h, biases, multi-head attention; 12h^2 + 13h parameters per layer (Narayanan et al.
2021, Sec. 5.1). The LLaMA-style options (Touvron et al. 2023; Dubey et al. 2024, "The Llama 3
Herd of Models", Sec. 3.1.1 and Table 3) are those Megatron-Core's TransformerConfig takes:
``rope_theta`` (rotary position embedding, Su et al. 2021, Eq. 34, on the query and key
heads), ``num_kv_heads`` (grouped-query attention, Ainslie et al. 2023: each K/V head serves
num_heads / num_kv_heads query heads), ``mlp=swiglu`` (Shazeer 2020, Eq. 6: fc1 holds the
gate and up projections, [gate; up], as Megatron's fused linear_fc1 does), ``norm=rmsnorm``
(Zhang & Sennrich 2019, Eq. 4) and ``bias=false``.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import ModelConfig
from .packing import Documents, self_mask

#: the norms' epsilon (Megatron-LM's --norm-epsilon default)
NORM_EPS = 1e-5


def make_norm(cfg: ModelConfig) -> nn.Module:
    """The model's norm over the hidden size: LayerNorm (weight and bias, whatever ``bias``
    says of the linears, as in Megatron-Core) or RMSNorm (a weight only)."""
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(cfg.hidden_size, eps=NORM_EPS)
    return nn.LayerNorm(cfg.hidden_size, eps=NORM_EPS)


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE (Su et al. 2021, Eq. 34) on heads ``x`` [b, heads, s, d] at ``positions`` ([s] or
    [b, s]), in the rotate-half layout of LLaMA and Megatron-Core (dimension i pairs with
    i + d/2; frequency theta^(-2i/d))."""
    d = x.shape[-1]
    freq = theta ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    angle = positions.to(torch.float32)[..., None] * freq  # [.., s, d/2]
    if angle.dim() == 3:
        angle = angle[:, None]  # per sample: [b, 1, s, d/2]
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    half = torch.cat([-x[..., d // 2:], x[..., : d // 2]], dim=-1)
    return (x.float() * cos + half.float() * sin).to(x.dtype)


class Embedding(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.pos = nn.Embedding(cfg.seq_length, cfg.hidden_size) if cfg.position_embeddings \
            else None

    def forward(self, tokens: torch.Tensor, docs: Documents | None = None) -> torch.Tensor:
        """Token plus position embeddings; with packed ``docs`` the positions are those
        within each token's document (``packing``)."""
        x = self.tok(tokens)
        if self.pos is not None:
            x = x + (self.pos.weight[: tokens.shape[1]] if docs is None
                     else self.pos(docs.pos))
        return x


class Attention(nn.Module):
    """Causal self-attention with ``num_kv_heads`` K/V heads (0: one per query head); the
    fused qkv projection's rows are [Q (num_heads); K (kv heads); V (kv heads)] x head_dim."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.kv_heads = cfg.num_heads, cfg.num_kv_heads or cfg.num_heads
        self.head_dim, self.rope_theta = cfg.head_dim, cfg.rope_theta
        width = (self.num_heads + 2 * self.kv_heads) * self.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, width, bias=cfg.bias)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=cfg.bias)

    def forward(self, x: torch.Tensor, docs: Documents | None = None) -> torch.Tensor:
        """Causal self-attention; with packed ``docs``, within each document only (and
        rotary positions restarted with them)."""
        b, s, h = x.shape
        q, k, v = self.heads(self.qkv(x), docs)
        mask = None if docs is None else self_mask(docs)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        return self.proj(y.transpose(1, 2).reshape(b, s, h))

    def heads(self, qkv: torch.Tensor, docs: Documents | None = None, expand: bool = True):
        """q, k, v as [b, num_heads, s, d] from the fused projection [b, s, width]
        (:func:`split_heads`)."""
        return split_heads(qkv, self.num_heads, self.kv_heads, self.head_dim,
                           self.rope_theta, docs, expand)


def split_heads(qkv: torch.Tensor, nq: int, nkv: int, d: int, rope_theta: float = 0.0,
                docs: Documents | None = None, expand: bool = True):
    """q, k, v as [b, nq, s, d] from a fused projection [b, s, (nq + 2 nkv) d] laid out
    [Q; K; V]: K/V heads repeated over their query group of nq / nkv heads (``expand=False``:
    k, v keep their nkv heads, as a context-parallel core moves them), RoPE applied to q and
    k at the positions 0..s-1 of whole sequences, or within each packed document (``docs``)."""
    b, s, _ = qkv.shape
    q, k, v = qkv.split([nq * d, nkv * d, nkv * d], dim=-1)
    q, k, v = (t.reshape(b, s, -1, d).transpose(1, 2) for t in (q, k, v))
    if rope_theta:
        pos = torch.arange(s, device=qkv.device) if docs is None else docs.pos
        q, k = rotate(q, pos, rope_theta), rotate(k, pos, rope_theta)
    if nkv != nq and expand:
        k, v = (t.repeat_interleave(nq // nkv, dim=1) for t in (k, v))
    return q, k, v


def mlp_activation(u: torch.Tensor, mlp: str) -> torch.Tensor:
    """fc1's output -> fc2's input: GELU, or SwiGLU (Shazeer 2020, Eq. 6) on [gate; up],
    silu(gate) * up. A tensor-parallel shard passes its own [gate_r; up_r] columns."""
    if mlp == "swiglu":
        gate, up = u.chunk(2, dim=-1)
        return F.silu(gate) * up
    return F.gelu(u)


class MLP(nn.Module):
    """h -> f -> h with GELU, or SwiGLU (fc1: [gate; up], 2f rows); f = ``ffn`` (a routed or
    shared expert's hidden size) or the model's ``cfg.ffn``."""

    def __init__(self, cfg: ModelConfig, ffn: int | None = None):
        super().__init__()
        f = ffn or cfg.ffn
        self.swiglu = cfg.mlp == "swiglu"
        self.fc1 = nn.Linear(cfg.hidden_size, f * (2 if self.swiglu else 1), bias=cfg.bias)
        self.fc2 = nn.Linear(f, cfg.hidden_size, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(mlp_activation(self.fc1(x), "swiglu" if self.swiglu else "gelu"))


class Head(nn.Module):
    """Final norm + LM head + mean token cross-entropy."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln = make_norm(cfg)
        self.out = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.out(self.ln(x))
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                               targets.reshape(-1))
