"""Realistic bugs in the DeepSeek-V3-style MoE of the expert family (DeepSeek-V3 Technical
Report, arXiv 2412.19437, Sec. 2.1.2): the auxiliary-loss-free balancing bias, the shared
expert's gradients, group-limited routing, the routed scaling factor. Each runs ``expert.alltoall`` on ``deepseek-tiny``
(first layer dense, 8 fine-grained experts top-2, one shared expert, the sigmoid router with
the bias, 2 groups keeping 1) at ep = dp = 2; the scaling mutant with the factor 2.5."""
from __future__ import annotations

import torch
import torch.distributed as dist

from parbench.model.router import select

from impls.expert.dispatch import ExpertDispatch
from impls.expert.scheme import ExpertAllToAll

from .catalogue import mutant

#: the preset and its expert count (the family's case sets num_experts=4)
DEEPSEEK = {"model": "deepseek-tiny", "num_experts": "8"}


# ---- the balancing bias ------------------------------------------------------------------------


@mutant("ds-bias-local-load", base="expert.alltoall", overrides=DEEPSEEK,
        bug="balancing bias updated from each rank's own load: the loads are all-reduced "
            "into a copy and the update reads the local tensor, so the ranks' biases drift "
            "apart (DeepSeek's bias must follow the global load)")
class BiasFromLocalLoad(ExpertAllToAll):
    def global_load(self, local):
        total = local.clone()  # a copy: the all-reduce never reaches ``local``
        if self.dp > 1:
            dist.all_reduce(total, group=self.ctx.mesh.group("dp"))
        return local


def selecting(select_experts) -> type:
    """An ``ExpertDispatch`` whose expert choice and gates are ``select_experts`` (a buggy
    copy of ``select``): the one change each routing mutant below makes."""
    return type(f"Selecting{select_experts.__name__}", (ExpertDispatch,),
                {"select_experts": staticmethod(select_experts)})


def _gates_with_bias(scores, k, rule, bias):
    top_e, _ = select(scores, k, rule, bias)
    biased = scores if bias is None else scores + bias
    top = biased.gather(1, top_e)
    # the bug: the gates normalise the biased scores (DeepSeek-V3 Eq. 13 uses s, not s + b)
    return top_e, top / top.sum(-1, keepdim=True)


@mutant("ds-bias-in-gates", base="expert.alltoall", overrides=DEEPSEEK,
        bug="balancing bias added to the gate weights, not only to the choice of experts: "
            "the gates are the chosen s + b normalised instead of the chosen s")
class BiasInGates(ExpertAllToAll):
    dispatch_class = selecting(_gates_with_bias)


# ---- the shared expert's gradients -------------------------------------------------------------


def _shared_params(model) -> list[torch.nn.Parameter]:
    return [p for n, p in model.named_parameters() if ".mlp.shared_expert." in n]


@mutant("ds-shared-grad-summed", base="expert.alltoall", overrides=DEEPSEEK,
        bug="shared expert's gradients summed over dp instead of averaged: its share of "
            "the flat dense all-reduce is scaled back by dp")
class SharedGradsSummed(ExpertAllToAll):
    def reduce_dense_gradients(self):
        super().reduce_dense_gradients()
        for p in _shared_params(self.model):
            p.grad.mul_(self.dp)


@mutant("ds-shared-as-expert", base="expert.alltoall", overrides=DEEPSEEK,
        bug="shared expert taken for a routed expert by a name filter ('expert' in the "
            "name): its gradients go to the expert bucket, reduced over edp only, never "
            "over the ep replicas that hold the same shared expert")
class SharedAsExpert(ExpertAllToAll):
    expert_param = staticmethod(lambda name: ".mlp." in name and "expert" in name)


# ---- group-limited routing ---------------------------------------------------------------------


def _groups_by_max(scores, k, rule, bias):
    choice = scores if bias is None else scores + bias
    t, e = choice.shape
    # the bug: a group's score is its best expert's, not the sum of its top 2 (Sec. 2.1.2)
    score = choice.view(t, rule.groups, e // rule.groups).amax(-1)
    kept = score.topk(rule.topk_groups, dim=-1).indices
    mask = torch.zeros(t, rule.groups, dtype=torch.bool).scatter_(1, kept, True)
    mask = mask.unsqueeze(-1).expand(t, rule.groups, e // rule.groups).reshape(t, e)
    top_e = choice.masked_fill(~mask, float("-inf")).topk(k, dim=-1).indices
    top_s = scores.gather(1, top_e)
    return top_e, top_s / top_s.sum(-1, keepdim=True)


@mutant("ds-groups-by-max", base="expert.alltoall", overrides=DEEPSEEK,
        bug="group-limited routing keeps the groups of highest single affinity (max) "
            "instead of the highest sum of their top-2 affinities")
class GroupsByMax(ExpertAllToAll):
    dispatch_class = selecting(_groups_by_max)


# ---- the routed scaling factor ----------------------------------------------------------------


def _scaled_before_normalising(scores, k, rule, bias):
    top_e, _ = select(scores, k, rule, bias)
    # the bug: the factor multiplies the chosen scores before their normalisation, where it
    # cancels (Megatron-Core's topk_routing_with_score_function scales the normalised gates)
    top_s = scores.gather(1, top_e) * rule.scaling
    return top_e, top_s / top_s.sum(-1, keepdim=True)


@mutant("ds-scaling-before-normalisation", base="expert.alltoall",
        overrides={**DEEPSEEK, "moe_router_scaling": "2.5"},
        bug="routed scaling factor applied to the chosen affinities before the top-k "
            "normalisation, so it cancels: the gates sum to 1 instead of the factor 2.5")
class ScalingBeforeNormalising(ExpertAllToAll):
    dispatch_class = selecting(_scaled_before_normalising)


# ---- the balancing loss under the bias and the group limit -------------------------------------


class _CountsRouted(ExpertDispatch):
    @staticmethod
    def balance_experts(scores, top_e, k, rule, bias):
        # the bug: f_i counts the routed experts (chosen with the bias, within the kept
        # groups) instead of each token's top-k of its unbiased affinities (Eq. 18)
        return top_e


@mutant("ds-aux-counts-routed-experts", base="expert.alltoall",
        overrides={**DEEPSEEK, "moe_aux_loss_coef": "0.01"},
        bug="the balancing loss's f_i counts the experts each token is routed to (biased, "
            "group-limited) instead of its top-k unbiased affinities over all experts "
            "(DeepSeek-V3 Eq. 18)")
class AuxCountsRouted(ExpertAllToAll):
    dispatch_class = _CountsRouted
