"""Gradient clipping by global norm on the five-axis hybrid (``clip_grad``).

Clipping (Pascanu, Mikolov and Bengio 2013, Alg. 1) rescales the whole gradient by
min(1, clip / ||g||); ||g|| must count every parameter of the model exactly once although
after the step's reductions (``impls.hybrid.scheme``) a rank holds it in pieces:

- **tp**: a tp-sharded parameter's pieces are disjoint, a tp-replicated one (LayerNorms,
  row-parallel biases, the position embedding, the routers -- summed over tp already) is a
  copy on every tp rank: counted on tp rank 0 only, as Megatron-LM's ``clip_grad_norm_fp32``
  counts only parameters that are not a tensor-parallel duplicate;
- **dp_cp** (dense) and **edp** (experts): with ZeRO-0 every replica holds the whole reduced
  gradient (nothing to add); with ZeRO 1-3 the rank owns its slice of the group's flat buffer
  (``GradientGroup.owned_sq``; the padding is no parameter), summed over the group, as
  Megatron's distributed optimizer does;
- **ep**: the experts are whole and sharded over ep: summed over the ep group (Megatron's
  expert optimizer reduces its own norm over the expert groups);
- **pp**: every stage on its own pp rank, summed over pp once both sums above are added; a
  bidirectional schedule's two stage copies (identical after ``replicas.sync_gradients``)
  are counted from the pipe-0 copy only (the one the verdict is shown).

So the dense squares are all-reduced over tp (and dp_cp with ZeRO), the experts' over ep (and
edp with ZeRO), their sum over pp: one 4-byte all-reduce per axis the gradient is spread over
(``parbench.analytic.hybrid``). Every rank then scales its gradients by the same factor.
"""
from __future__ import annotations

import torch.distributed as dist

from parbench.model.training import clip_coefficient

EXPERT_MARK = ".mlp.experts."


def counted_params(slots: dict, tp_rank: int, bidirectional: bool) -> set[int]:
    """Ids of the local parameters whose gradients this rank counts: not a tp duplicate
    (tp-replicated non-expert parameters on tp rank 0 only) and not a second stage copy
    (pipe 0 only under a bidirectional schedule)."""
    out: set[int] = set()
    for slot in slots.values():
        if bidirectional and slot.pipe != 0:
            continue
        for name, (local, pl) in slot.module.shards().items():
            if pl.replicated and tp_rank != 0 and EXPERT_MARK not in name:
                continue
            out.add(id(local))
    return out


def all_reduce_over(sq, mesh, axes) -> None:
    """Sum the one-element ``sq`` over each axis of ``axes`` of more than one rank."""
    for axis in axes:
        if mesh.size(axis) > 1:
            dist.all_reduce(sq, group=mesh.group(axis))


def norm_axes(scheme) -> tuple[list[str], list[str]]:
    """(dense axes, expert axes) the two groups' owned squares are summed over: tp and ep,
    plus the gradient groups' own axes when ZeRO shards them."""
    dense_axis, expert_axis = scheme.gradient_axes
    zero = scheme.ctx.options.data.zero_stage > 0
    dense = ["tp"] + ([dense_axis] if zero else [])
    expert = (["ep"] + ([expert_axis] if zero else [])) if scheme.ctx.model.num_experts else []
    return dense, expert


def hybrid_norm(scheme, counted: set[int], dense_axes, expert_axes) -> float:
    """The global gradient norm of ``scheme`` (a ``HybridScheme`` after its reductions): the
    ``counted`` parameters' owned squares of the dense group summed over ``dense_axes``, the
    experts' over ``expert_axes``, their sum over pp."""
    mesh, dev = scheme.ctx.mesh, scheme.ctx.device
    dense_group, expert_group = scheme.groups
    dense = dense_group.owned_sq(counted).to(dev)
    all_reduce_over(dense, mesh, dense_axes)
    expert = expert_group.owned_sq(counted).to(dev)
    all_reduce_over(expert, mesh, expert_axes)
    total = dense + expert
    all_reduce_over(total, mesh, ["pp"])
    return float(total.sqrt())


def clip_hybrid_(scheme, norm: float) -> None:
    """Scale every gradient group of ``scheme`` by the factor of ``norm``."""
    coef = clip_coefficient(norm, scheme.ctx.run.clip_grad)
    for g in scheme.groups:
        g.scale_(coef)
