"""Deterministic initialisation: every parameter from its own generator, seeded by (seed,
full name), so any partition of the model (a pipeline stage, a shard) rebuilds exactly the
same full weights without materialising the rest."""
from __future__ import annotations

import zlib

import torch
import torch.nn as nn


def param_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


def init_parameters(module: nn.Module, seed: int, std: float, prefix: str = "") -> None:
    """Normal(0, std) for weights of linears/embeddings, zeros for biases, ones for the
    norms (LN, and MLA's latent norms ``q_norm`` / ``kv_norm``)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            full = prefix + name
            if full.endswith("ln1.weight") or full.endswith("ln2.weight") or \
                    full.endswith("ln.weight") or full.endswith("_norm.weight"):
                p.fill_(1.0)
            elif full.endswith(".bias"):
                p.zero_()
            else:
                g = torch.Generator().manual_seed(param_seed(seed, full))
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32) * std)
