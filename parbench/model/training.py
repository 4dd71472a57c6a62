"""What every scheme and the golden run train with: the optimizer and the compute dtype."""
from __future__ import annotations

import torch


def make_optimizer(params, run_cfg) -> torch.optim.Optimizer:
    """The optimizer every scheme and the golden run use (single-tensor, not foreach, so the
    arithmetic is elementwise-identical on a flat shard and on the full tensors)."""
    params = list(params)
    if run_cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=run_cfg.lr, weight_decay=run_cfg.weight_decay,
                               foreach=False)
    return torch.optim.AdamW(params, lr=run_cfg.lr, betas=(run_cfg.beta1, run_cfg.beta2),
                             eps=run_cfg.eps, weight_decay=run_cfg.weight_decay,
                             foreach=False)


def compute_dtype(run_cfg) -> torch.dtype:
    return torch.bfloat16 if run_cfg.dtype == "bf16" else torch.float32
