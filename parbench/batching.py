"""Slicing the global batch: a data-parallel rank's rows, and micro-batches."""
from __future__ import annotations

import torch


def dp_slice(x: torch.Tensor, dp_rank: int, dp_size: int) -> torch.Tensor:
    """Rows of the global batch that data-parallel rank ``dp_rank`` trains on."""
    per = x.shape[0] // dp_size
    return x[dp_rank * per:(dp_rank + 1) * per]


def microbatches(x: torch.Tensor, y: torch.Tensor, m: int):
    """Split a local batch into ``m`` equal micro-batches: a list of (inputs, targets)."""
    return list(zip(x.chunk(m), y.chunk(m)))
