"""Multi-head latent attention (DeepSeek-V2, DeepSeek-AI 2024, arXiv 2405.04434, Sec. 2.1.2-
2.1.3, Eqs. 9-19; DeepSeek-V3, arXiv 2412.19437, Sec. 2.1.1, Eqs. 1-11), on when
``kv_lora_rank`` > 0.

Per token x (hidden h; a heads; d_c = kv_lora_rank, d_c' = q_lora_rank, d = qk_head_dim,
d_R = qk_rope_head_dim, d_v = v_head_dim):

- the query latent c_Q = RMSNorm(W_DQ x) (Eq. 12; ``q_down``, ``q_norm``) and the queries
  [q_C; q_R] = W_UQ c_Q, per head d + d_R wide (Eqs. 13-14, ``q_up``; q_R rotated by RoPE);
  with d_c' = 0 the queries come from x directly (``q_proj``, DeepSeek-V2-Lite);
- one projection ``kv_down`` (Megatron-Core's linear_kv_down_proj) gives the K/V latent c_KV
  (d_c, Eq. 9, normalised by ``kv_norm``) and the decoupled key k_R (d_R, Eq. 15: one rotary
  key shared by every head);
- ``kv_up`` gives each head's [k_C; v_C] (d + d_v, Eqs. 10-11, the rows head by head as
  Megatron-Core's linear_kv_up_proj); the key is [k_C; k_R] (Eq. 16);
- softmax(q^T k / sqrt(d + d_R)) v per head (Eq. 17), causal, and ``proj`` (W_O, Eq. 18).

No biases (Megatron-Core's MLA linears have none). The parameter tensors, in this order, are
those ``parbench.analytic.mla.mla_linears`` counts.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import ModelConfig
from .packing import Documents, self_mask

#: the latents' RMSNorm epsilon (the blocks' NORM_EPS)
LATENT_EPS = 1e-5


@dataclass(frozen=True)
class MLADims:
    """Widths of one MLA layer: heads a, d (no-rope q/k), d_R (rope), d_v, d_c, d_c'."""

    heads: int
    qk: int
    rope: int
    v: int
    kv_rank: int
    q_rank: int

    @classmethod
    def of(cls, cfg: ModelConfig) -> "MLADims":
        return cls(cfg.num_heads, cfg.qk_head_dim or cfg.head_dim, cfg.qk_rope_head_dim,
                   cfg.v_head_dim or cfg.head_dim, cfg.kv_lora_rank, cfg.q_lora_rank)

    @property
    def scale(self) -> float:
        """The softmax scale 1 / sqrt(d + d_R) (DeepSeek-V2 Eq. 17)."""
        return 1.0 / math.sqrt(self.qk + self.rope)


def latent_heads(q: torch.Tensor, kv: torch.Tensor, k_rope: torch.Tensor, heads: int,
                 dims: MLADims, pos: torch.Tensor, theta: float):
    """q, k, v [b, heads, s, .] from the up projections' outputs (``heads`` of them):
    q [b, s, heads (d + d_R)], kv [b, s, heads (d + d_v)], the shared rope key
    k_rope [b, s, d_R]; RoPE on q_R and k_R at ``pos`` (Eqs. 14-16)."""
    from .blocks import rotate
    b, s, _ = q.shape
    q = q.reshape(b, s, heads, dims.qk + dims.rope).transpose(1, 2)
    kv = kv.reshape(b, s, heads, dims.qk + dims.v).transpose(1, 2)
    q_c, q_r = q.split([dims.qk, dims.rope], dim=-1)
    k_c, v = kv.split([dims.qk, dims.v], dim=-1)
    k_r = k_rope.unsqueeze(1)  # [b, 1, s, d_R]: one key for every head
    if dims.rope:
        q_r, k_r = rotate(q_r, pos, theta), rotate(k_r, pos, theta)
    k = torch.cat([k_c, k_r.expand(-1, heads, -1, -1)], dim=-1)
    return torch.cat([q_c, q_r], dim=-1), k, v


def latent_attention(q, k, v, dims: MLADims, mask=None) -> torch.Tensor:
    """softmax(q k^T / sqrt(d + d_R)) v, causal (or ``mask``): [b, heads, s, d_v]."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                          scale=dims.scale)


class LatentAttention(nn.Module):
    """The reference MLA layer (module docstring); parameter names as in Megatron-Core's
    MLASelfAttention without its ``linear_`` prefixes."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.dims = d = MLADims.of(cfg)
        self.rope_theta = cfg.rope_theta
        h, a = cfg.hidden_size, d.heads
        if d.q_rank:
            self.q_down = nn.Linear(h, d.q_rank, bias=False)
            self.q_norm = nn.RMSNorm(d.q_rank, eps=LATENT_EPS)
            self.q_up = nn.Linear(d.q_rank, a * (d.qk + d.rope), bias=False)
        else:
            self.q_proj = nn.Linear(h, a * (d.qk + d.rope), bias=False)
        self.kv_down = nn.Linear(h, d.kv_rank + d.rope, bias=False)
        self.kv_norm = nn.RMSNorm(d.kv_rank, eps=LATENT_EPS)
        self.kv_up = nn.Linear(d.kv_rank, a * (d.qk + d.v), bias=False)
        self.proj = nn.Linear(a * d.v, h, bias=False)

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        if self.dims.q_rank:
            return self.q_up(self.q_norm(self.q_down(x)))
        return self.q_proj(x)

    def forward(self, x: torch.Tensor, docs: Documents | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        d = self.dims
        latent, k_rope = self.kv_down(x).split([d.kv_rank, d.rope], dim=-1)
        pos = torch.arange(s, device=x.device) if docs is None else docs.pos
        q, k, v = latent_heads(self.queries(x), self.kv_up(self.kv_norm(latent)), k_rope,
                               d.heads, d, pos, self.rope_theta)
        mask = None if docs is None else self_mask(docs)
        y = latent_attention(q, k, v, d, mask)
        return self.proj(y.transpose(1, 2).reshape(b, s, d.heads * d.v))
