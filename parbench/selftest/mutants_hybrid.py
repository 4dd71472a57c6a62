"""Realistic bugs in the five-axis hybrid (see mutants_data): each replaces one piece of
``impls.hybrid`` -- a gradient reduction over one of its groups, the MoE token split over
tp, the auxiliary-loss scale -- and registers as a scheme of its own. The base case
(``FAMILY_CASES['hybrid']``) is an MoE model on tp 2 x dp 2 with ep 2 (experts whole, edp 2)."""
from __future__ import annotations

from impls.hybrid.model import HybridStage
from impls.hybrid.scheme import HybridScheme
from impls.tensor.collectives import ReduceFromRegion

from .catalogue import mutant


class _PartialRouterStage(HybridStage):
    def tp_partial_params(self):
        return []  # the bug: router gradients left partial over tp


@mutant("hybrid-router-not-reduced", base="hybrid",
        bug="router gradients are partial over tp (tokens split) but not summed over tp")
class HybridRouterNotReduced(HybridScheme):
    stage_class = _PartialRouterStage


class _EdpMean(HybridScheme):
    def reduce_experts(self, grads, n):
        super().reduce_experts(grads, n)
        edp = self.ctx.mesh.size("edp")
        for g in grads:
            g.div_(edp)  # the bug: averaged over edp as if it were the data-parallel group


@mutant("hybrid-expert-grads-edp-mean", base="hybrid",
        bug="expert gradients averaged over the expert-data-parallel group, then over dp cp")
class HybridExpertGradsEdpMean(_EdpMean):
    pass


class _UnsplitStage(HybridStage):
    def mlp(self, i, x):
        if i not in self._experts or self.tp == 1 or self.sp:
            return super().mlp(i, x)
        from impls.expert.dispatch import moe_tokens
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

