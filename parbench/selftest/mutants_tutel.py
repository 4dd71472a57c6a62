"""Realistic bugs in ``expert.tutel`` (see mutants_expert): the 2-D all-to-all's re-layout
between its phases, the DP mode's gradient path back to the expert owners, the capacity's
upper bound and the capacity's agreement over the ep group. Each replaces one step of the
scheme and registers as a scheme of its own."""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from parbench.model.moe import route, skew_of

from impls.expert.tutel import ExpertTutel
from impls.expert.tutel_dispatch import GatherExperts, TutelDispatch

from .catalogue import mutant

# ---- the 2-D all-to-all ----------------------------------------------------------------------


def _no_relayout(y, local, nodes):
    return y.contiguous()  # the bug: blocks stay grouped by local source, not by node


@mutant("tutel-2d-relayout", base="expert.tutel",
        overrides={"ep": "4", "dp": "4", "moe_a2a": "2d"},
        bug="2-D all-to-all without the re-layout between the intra- and inter-node phases: "
            "the inter-node phase sends the blocks of local source i to node i, so tokens "
            "reach the wrong experts")
class TwoDimNoRelayout(ExpertTutel):
    def two_dim_plan(self):
        plan = super().two_dim_plan()
        plan.between = _no_relayout
        return plan


# ---- DP mode -----------------------------------------------------------------------------------


class _GatherNoReduce(GatherExperts):
    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist
        rank = dist.get_rank(ctx.group)  # the bug: keep this rank's slice, no reduce-scatter
        n = grad.numel() // ctx.ep
        return grad[rank * n:(rank + 1) * n].clone(), None, None


class _DispatchNoReduce(TutelDispatch):
    gather_fn = _GatherNoReduce


@mutant("tutel-dp-grads-unreduced", base="expert.tutel", overrides={"moe_mode": "dp"},
        bug="DP mode takes the owner's slice of the gathered experts' gradients instead of "
            "reduce-scattering them: each expert learns from its owner's tokens only")
class DpGradsNotReduced(ExpertTutel):
    dispatch_class = _DispatchNoReduce


# ---- adaptive capacity -------------------------------------------------------------------------


class _Unbounded(TutelDispatch):
    def route(self, x, router_weight, groups, bias=None):
        cfg = self.cfg
        # the bug: the adaptive capacity ignores the factor's upper bound (nothing dropped)
        return route(x, router_weight, groups, cfg.moe_top_k, 0.0, cfg.moe_aux_loss_coef,
                     cfg.moe_z_loss_coef, *skew_of(cfg))


@mutant("tutel-capacity-unbounded", base="expert.tutel",
        overrides={"moe_capacity_factor": "1"},
        bug="adaptive capacity ignores moe_capacity_factor's upper bound: the tokens the "
            "Switch capacity drops are kept (a larger buffer than the bound allows)")
class CapacityUnbounded(ExpertTutel):
    dispatch_class = _Unbounded


class _TopChoiceNeed(TutelDispatch):
    @staticmethod
    def local_need(r):
        first = r.slot[:, 0][r.kept[:, 0]]  # the bug: the need of the first choices only
        return int(first.max()) + 1 if first.numel() else 0

    @staticmethod
    def slots(r, groups, num_experts):
        # ... and the buffer's capacity then drops what does not fit
        fits = replace(r, kept=r.kept & (r.slot < r.capacity))
        return TutelDispatch.slots(fits, groups, num_experts)


@mutant("tutel-need-first-choice", base="expert.tutel",
        overrides={"moe_top_k": "2", "moe_capacity_factor": "0"},
        bug="the capacity need counts first choices only (top-2): second choices beyond it "
            "do not fit the buffer and are dropped although the reference keeps them")
class NeedFirstChoice(ExpertTutel):
    dispatch_class = _TopChoiceNeed


class _MinCapacity(TutelDispatch):
    def agree(self, need, device):
        t = torch.tensor([need], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)  # the bug: MIN, not MAX
        return int(t.item())

    @staticmethod
    def slots(r, groups, num_experts):
        # ... and the buffer's capacity then drops what does not fit (Tutel's overflow rule)
        fits = replace(r, kept=r.kept & (r.slot < r.capacity))
        return TutelDispatch.slots(fits, groups, num_experts)


# A capacity taken from the rank's own need with no all-reduce at all cannot produce numbers:
# the ranks' buffers differ in size and the equal-split all-to-all fails (gloo raises, NCCL
# hangs) -- a crash, not a bug a check judges. Its numeric sibling: the agreement with the
# wrong reduction, which every rank follows.
@mutant("tutel-capacity-min", base="expert.tutel",
        overrides={"moe_capacity_factor": "0"},
        bug="the ep group agrees on its smallest per-expert need (all-reduce MIN, not MAX): "
            "the ranks whose tokens need more slots drop them although the reference keeps "
            "them")
class CapacityMin(ExpertTutel):
    dispatch_class = _MinCapacity
