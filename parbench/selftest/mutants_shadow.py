"""Realistic bugs in ``expert.fastermoe`` (see mutants_expert): the shadows' gradients not
reduced to their owner, shadow copies cached across steps (stale after the optimizer step),
the owner's own copy counted twice. Each replaces one step of
:class:`impls.expert.shadow.ShadowDispatch` and registers as a scheme of its own; all run on
a skewed router with one shadow per MoE layer.

Not in the catalogue: shadows chosen from each rank's *local* counts. When the ranks then
disagree, their broadcasts and split sizes no longer match and gloo aborts the process (a
size mismatch is a C++ abort, not a Python error), which would take the self-test's rank pool
down with it; on a strongly skewed router they agree and the bug is invisible.
"""
from __future__ import annotations

import torch.distributed as dist

from impls.expert.shadow import ExpertFasterMoE, ShadowDispatch

from .catalogue import mutant

SKEWED = {"moe_capacity_factor": "0", "moe_shadow": "1", "moe_router_skew": "2"}


class _NotReduced(ShadowDispatch):
    def reduce_shadow_grads(self):
        for _, leaf, mine in self.pending:
            # the bug: only the owner's own copy's gradient reaches the expert
            if mine is not None and leaf.grad is not None:
                self.add_to_owner(leaf.grad, mine)
        self.pending.clear()


@mutant("shadow-grad-not-reduced", base="expert.fastermoe", overrides=SKEWED,
        bug="shadow copies' gradients not reduced to the owner: the expert learns only from "
            "the owner's own tokens for it")
class ShadowGradsNotReduced(ExpertFasterMoE):
    dispatch_class = _NotReduced


class _Cached(ShadowDispatch):
    def fetch_shadow(self, expert, experts, first_expert, key):
        cache = self.__dict__.setdefault("cache", {})
        if (id(key), expert) not in cache:
            cache[(id(key), expert)] = super().fetch_shadow(expert, experts, first_expert, key)
            return cache[(id(key), expert)]
        # the bug: the copy made at the first step is reused, never refreshed from the owner
        leaf = cache[(id(key), expert)].detach().clone().requires_grad_()
        own = expert // len(experts)
        self.pending.append((own, leaf, experts[expert - first_expert]
                             if own == self.ep_rank else None))
        return leaf


@mutant("shadow-stale-params", base="expert.fastermoe", overrides=SKEWED,
        bug="shadow parameters broadcast once and cached: after the first optimizer step "
            "the ranks compute the popular expert with stale weights")
class ShadowStaleParams(ExpertFasterMoE):
    dispatch_class = _Cached


class _OwnerTwice(ShadowDispatch):
    def reduce_shadow_grads(self):
        for own, leaf, mine in self.pending:
            local = leaf.grad.clone()
            dist.reduce(leaf.grad, dst=dist.get_global_rank(self.group, own), group=self.group)
            if mine is not None:
                self.add_to_owner(leaf.grad, mine)
                self.add_to_owner(local, mine)  # the bug: its own copy's gradient again
        self.pending.clear()


@mutant("shadow-owner-twice", base="expert.fastermoe", overrides=SKEWED,
        bug="the owner adds its own copy's gradient after the reduce that already summed it: "
            "the owner's tokens count twice for the shadowed expert")
class ShadowOwnerTwice(ExpertFasterMoE):
    dispatch_class = _OwnerTwice
