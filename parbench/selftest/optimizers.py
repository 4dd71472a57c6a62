"""Optimizers with the bugs people write: the update rules the mutants step with.

``BiasFreeAdamW`` is AdamW (Loshchilov & Hutter 2019, Algorithm 2) with the bias
correction of the moments left out (Kingma & Ba 2015, Sec. 3: m_t / (1 - beta1^t) and
v_t / (1 - beta2^t)): early steps are scaled wrongly, a classic slip when AdamW is
re-implemented over flat shards.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from ..model import make_optimizer


class BiasFreeAdamW(torch.optim.Optimizer):
    """AdamW without bias correction (a bug, on purpose)."""

    def __init__(self, params, *, lr, betas, eps, weight_decay):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                p.mul_(1 - group["lr"] * group["weight_decay"])
                state["exp_avg"].lerp_(p.grad, 1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                denom = state["exp_avg_sq"].sqrt().add_(group["eps"])
                p.addcdiv_(state["exp_avg"], denom, value=-group["lr"])


def make_buggy_optimizer(params, run, bug: str):
    """The run's optimizer with one bug: ``no-wd`` (weight decay dropped), ``double-wd``
    (applied twice), ``no-bias-correction``."""
    if bug == "no-bias-correction":
        return BiasFreeAdamW(list(params), lr=run.lr, betas=(run.beta1, run.beta2),
                             eps=run.eps, weight_decay=run.weight_decay)
    factor = {"no-wd": 0.0, "double-wd": 2.0}[bug]
    return make_optimizer(params, replace(run, weight_decay=run.weight_decay * factor))
