"""Synthetic data: deterministic random tokens, the same global batch on every rank and in
the golden run."""
from __future__ import annotations

import torch

from ..config import ModelConfig


def synthetic_batch(cfg: ModelConfig, batch_size: int, seed: int, step: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic random tokens for one global batch: (inputs, targets), each [B, s]."""
    g = torch.Generator().manual_seed(seed * 7919 + step * 104_729 + 17)
    tokens = torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_length + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
