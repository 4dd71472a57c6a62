"""Realistic bugs in the five-axis hybrid (see mutants_data): each replaces one piece of
``impls.hybrid`` -- a gradient reduction over one of its groups, the MoE token split over
tp, the auxiliary-loss scale, the split backward's W pass, the bidirectional schedules'
replica exchange -- and registers as a scheme of its own. The base case
(``FAMILY_CASES['hybrid']``) is an MoE model on tp 2 x dp 2 with ep 2 (experts whole, edp 2)."""
from __future__ import annotations

from impls.common import backward_pass

from impls.expert.dispatch import moe_tokens
from impls.hybrid.model import HybridStage
from impls.hybrid.optimizer import GradientGroup
from impls.hybrid.scheme import HybridScheme
from impls.tensor.collectives import ReduceFromRegion
from impls.tensor.layers import ColumnParallelLinear

from .catalogue import mutant


class _PartialRouterStage(HybridStage):
    def tp_partial_params(self):
        return []  # the bug: router gradients left partial over tp


@mutant("hybrid-router-not-reduced", base="hybrid",
        bug="router gradients are partial over tp (tokens split) but not summed over tp")
class HybridRouterNotReduced(HybridScheme):
    stage_class = _PartialRouterStage


class _EdpMean(HybridScheme):
    def expert_divisor(self):
        # the bug: averaged over edp as if it were the data-parallel group
        return super().expert_divisor() * self.ctx.mesh.size("edp")


@mutant("hybrid-expert-grads-edp-mean", base="hybrid",
        bug="expert gradients averaged over the expert-data-parallel group, then over dp cp")
class HybridExpertGradsEdpMean(_EdpMean):
    pass


class _UnsplitStage(HybridStage):
    def mlp(self, i, x):
        if i not in self._experts or self.tp == 1 or self.sp:
            return super().mlp(i, x)
        tokens = x.reshape(-1, x.shape[-1])  # the bug: every tp rank routes every token
        y, stats = moe_tokens(tokens, self.p(f"blocks.{i}.mlp.router.weight"),
                              self._experts[i], self.first_expert, self.cfg, None,
                              self.ep_group, self.ep, self.aux_scale)
        self.moe_stats[i] = stats
        return ReduceFromRegion.apply(y.view(x.shape), self.group)


@mutant("hybrid-moe-tokens-not-split", base="hybrid",
        bug="every tp rank routes all tokens and the outputs are summed over tp (counted t "
            "times)")
class HybridMoETokensNotSplit(HybridScheme):
    stage_class = _UnsplitStage


class _AuxScaleStage(HybridStage):
    def __init__(self, *args, aux_scale=1.0, **kw):
        super().__init__(*args, aux_scale=aux_scale * kw["tp"], **kw)  # the bug: 1/m only


@mutant("hybrid-aux-scale-ignores-tp", base="hybrid", overrides={"moe_aux_loss_coef": "0.5"},
        bug="auxiliary loss scaled by 1/m, not 1/(m t): its gradient counted t times")
class HybridAuxScale(HybridScheme):
    stage_class = _AuxScaleStage



class _ObliviousColumn(ColumnParallelLinear):
    @staticmethod
    def backward(ctx, grad):
        with backward_pass.running(None):  # the bug: the whole backward in B and again in W
            return ColumnParallelLinear.backward(ctx, grad)


class _ObliviousStage(HybridStage):
    def column(self, x, weight, bias):
        return _ObliviousColumn.apply(x, weight, bias, self.group, self.tp if self.sp else 1)


@mutant("hybrid-split-w-reruns-allreduce", base="hybrid",
        overrides={"dp": "1", "pp": "2", "schedule": "zb-h1", "num_microbatches": "4"},
        bug="under a split backward the column-parallel linear ignores the pass: W runs its "
            "input-gradient all-reduce again (right numbers, twice the tp backward bytes)")
class HybridSplitReruns(HybridScheme):
    stage_class = _ObliviousStage


# Skipping the partner exchange altogether cannot reach a check: the two copies then differ,
# and the scheme's report of its parameters (``replicas.reported``) refuses to pick one -- a
# crash. Its numeric sibling: the exchange made, then averaged as data-parallel replicas are.
@mutant("hybrid-replicas-averaged", base="hybrid",
        overrides={"dp": "1", "pp": "2", "schedule": "chimera", "num_microbatches": "4"},
        bug="Chimera's two stage copies average their gradients after the partner exchange "
            "(a mean, as for data-parallel replicas) although each copy covers half of the "
            "micro-batches, whose losses are already scaled by 1/m: the gradients are halved")
class HybridReplicasAveraged(HybridScheme):
    def sync_replicas(self):
        super().sync_replicas()
        for slot in self.slots.values():
            for p in slot.params:
                p.grad.div_(2)  # the bug: the sum of the two pipes' halves is the gradient


@mutant("hybrid-zero1-shards-over-dp-only", base="hybrid",
        overrides={"tp": "1", "cp": "2", "zero_stage": "1"},
        bug="the distributed optimizer's reduce-scatter runs over dp, not dp x cp: the "
            "context-parallel ranks' gradient contributions are never added")
class HybridZeroOverDpOnly(HybridScheme):
    gradient_axes = ("dp", "edp")


class _KeepsGathered(GradientGroup):
    def finish(self):
        zero, self.zero = self.zero, min(self.zero, 2)
        try:  # the bug: ZeRO-3 all-gathers after the step like ZeRO-1 and keeps the buffer
            super().finish()
        finally:
            self.zero = zero


@mutant("hybrid-zero3-keeps-gathered-params", base="hybrid", overrides={"zero_stage": "3"},
        bug="ZeRO-3 all-gathers the updated parameters after the step and keeps them (full "
            "parameters between steps, one all-gather too many)")
class HybridZero3KeepsGathered(HybridScheme):
    group_class = _KeepsGathered
