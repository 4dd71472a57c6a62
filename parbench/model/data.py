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


#: the target value the loss leaves out (``torch.nn.functional.cross_entropy``'s default)
IGNORE_INDEX = -100


def mask_prompts(targets: torch.Tensor, fraction: float, seed: int, step: int
                 ) -> torch.Tensor:
    """``targets`` with each sample's first k positions set to ``IGNORE_INDEX``: prompt
    tokens an instruction-tuning loss leaves out, k drawn per sample in [0, fraction * s]
    (deterministic in seed and step), so that ranks and micro-batches hold different numbers
    of counted tokens while every sample keeps at least one (fraction < 1)."""
    b, s = targets.shape
    g = torch.Generator().manual_seed(seed * 6151 + step * 3571 + 29)
    k = torch.randint(0, int(fraction * s) + 1, (b,), generator=g)
    out = targets.clone()
    out[torch.arange(s).expand(b, s) < k[:, None]] = IGNORE_INDEX
    return out


def counted_tokens(targets: torch.Tensor) -> int:
    """How many targets the loss counts (not ``IGNORE_INDEX``)."""
    return int((targets != IGNORE_INDEX).sum())
