"""Gradient clipping by global norm when the experts are sharded over ep (``clip_grad``).

The norm clipping needs (Pascanu, Mikolov and Bengio 2013, Alg. 1: rescale the whole gradient
when its norm passes a threshold) is that of the *whole* model: every parameter counted once.
Under expert parallelism the gradient is held in two ways after its reduction:

- the dense parameters (the routers included) are replicated over the ep x edp = dp ranks
  after their all-reduce, so each rank adds their squares itself and nothing is reduced;
- the experts are sharded over ep (each rank holds E/ep of every MoE layer, whole) and
  replicated over edp, so the squares of the rank's own experts are summed over the ep group
  (one all-reduce of one fp32 element) and not over edp. FasterMoE's shadows are copies that
  live inside the step; only the owner's expert is counted.

Megatron-LM's ``clip_grad_norm_fp32`` does the same in two parts: the dense optimizer's norm
reduced over its model-parallel group, the expert optimizer's over the expert-model-parallel
one, the two squared norms added (its ``ChainedOptimizer``). Reducing the experts' squares
over the local rank only, or the whole sum over a group that also holds the dense copies,
are the bugs of the self-test (``parbench.selftest.mutants_clip_expert``). Closed form: one
4-byte all-reduce on axis ep (``parbench.analytic.clip``), none when ep = 1.
"""
from __future__ import annotations

from parbench.model.training import grad_norm_sq

from impls.common.clip import summed_sq


def expert_parallel_norm(dense, experts, ep_group) -> float:
    """The global norm of a model whose ``dense`` gradients are whole on this rank and whose
    ``experts`` are this rank's shard over ``ep_group`` (the docstring above)."""
    sq = summed_sq(experts, [ep_group])
    return float((grad_norm_sq(dense).to(sq.device) + sq).sqrt())
