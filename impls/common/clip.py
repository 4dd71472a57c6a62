"""Gradient clipping by global norm on a rank that holds part of the gradients.

The global norm is sqrt(sum of g^2 over every parameter of the model, each counted once).
A rank adds the squares of the gradients it *owns* -- its shard of a sharded parameter, and a
replicated parameter on exactly one of the ranks that hold it -- and the 1-element fp32 sum
is all-reduced over each group the owned parts are spread over, one mesh axis at a time (so
the ledger books each call on its axis). Every rank then scales the gradients it steps on by
min(1, clip / (norm + 1e-6)) (``parbench.model.training.clip_coefficient``; Megatron-LM's
``clip_grad_norm_fp32``, which all-reduces the squared norm over the model-parallel group
and, with the distributed optimizer, the data-parallel group). What the closed forms count:
one all-reduce of 4 bytes per group of size > 1 (``parbench.analytic.clip``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from parbench.model.training import clip_coefficient, grad_norm_sq, scale_grads_


def summed_sq(tensors, groups=()) -> torch.Tensor:
    """Squares of ``tensors`` (fp32, one element) summed here, then over each group of
    ``groups`` of more than one rank (one all-reduce each)."""
    sq = grad_norm_sq(tensors)
    for g in groups:
        if g is not None and dist.get_world_size(g) > 1:
            dist.all_reduce(sq, group=g)
    return sq


def global_norm(owned, groups=()) -> float:
    """The global gradient norm: the squares of ``owned`` summed here, then over every group
    of ``groups`` (each of size > 1: one all-reduce each)."""
    return float(summed_sq(owned, groups).sqrt())


def clip_grads_(grads, max_norm: float, owned=None, groups=()) -> float | None:
    """Clip ``grads`` (the tensors this rank steps on) in place by the global norm of
    ``owned`` (default: ``grads``) summed over ``groups``; returns the norm, or None when the
    run does not clip (``max_norm`` 0: no collective either)."""
    if not max_norm:
        return None
    grads = [g for g in grads if g is not None]
    norm = global_norm(grads if owned is None else owned, groups)
    scale_grads_(grads, clip_coefficient(norm, max_norm))
    return norm
