"""The dense blocks of the reference GPT: learned token and position embeddings, causal
multi-head attention (within documents when sequences are packed: ``packing``), the MLP (h -> f -> h, GELU) and the head (final LN, LM head, mean token
cross-entropy). Parameter count per layer is 12h^2 + 13h for f = 4h (Narayanan et al. 2021,
Sec. 5.1)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import ModelConfig
from .packing import Documents, self_mask


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
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, docs: Documents | None = None) -> torch.Tensor:
        """Causal self-attention; with packed ``docs``, within each document only."""
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.num_heads, h // self.num_heads).unbind(2)
        mask = None if docs is None else self_mask(docs)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), attn_mask=mask,
                                           is_causal=mask is None)
        return self.proj(y.transpose(1, 2).reshape(b, s, h))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.ffn)
        self.fc2 = nn.Linear(cfg.ffn, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Head(nn.Module):
    """Final LN + LM head + mean token cross-entropy."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln = nn.LayerNorm(cfg.hidden_size)
        self.out = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.out(self.ln(x))
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                               targets.reshape(-1))
