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


#: added to the norm before dividing, as Megatron-LM's ``clip_grad_norm_fp32`` and
#: ``torch.nn.utils.clip_grad_norm_`` do
CLIP_EPS = 1e-6


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """The factor every gradient is multiplied by when clipping to ``max_norm`` by global
    norm (Pascanu, Mikolov, Bengio 2013, "On the difficulty of training recurrent neural
    networks", Alg. 1; Megatron-LM ``--clip-grad``): min(1, max_norm / (||g|| + 1e-6)).
    ``max_norm`` 0 means no clipping (1)."""
    if max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (total_norm + CLIP_EPS))


def grad_norm_sq(tensors) -> torch.Tensor:
    """Sum of squares of ``tensors`` in fp32, as one 1-element tensor (what a rank adds to
    the global norm's all-reduce)."""
    out = torch.zeros(1, dtype=torch.float32)
    for t in tensors:
        if t is not None and t.numel():
            out = out.to(t.device) + t.detach().float().pow(2).sum()
    return out


def scale_grads_(tensors, coef: float) -> None:
    """Multiply ``tensors`` in place by ``coef`` (nothing when it is 1)."""
    if coef >= 1.0:
        return
    with torch.no_grad():
        for t in tensors:
            if t is not None:
                t.mul_(coef)


def clip_local_(tensors, max_norm: float) -> float:
    """Clip ``tensors`` (the whole model's gradients, held here) in place by their global
    norm; returns the norm before clipping. The golden run's rule."""
    tensors = [t for t in tensors if t is not None]
    norm = float(grad_norm_sq(tensors).sqrt())
    scale_grads_(tensors, clip_coefficient(norm, max_norm))
    return norm
