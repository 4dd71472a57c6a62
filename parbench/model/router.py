"""The router's scores and its choice of experts: softmax (Switch, GShard) or sigmoid
(DeepSeek-V3), the auxiliary-loss-free balancing bias, group-limited routing. The rules
(DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", arXiv 2412.19437, Sec. 2.1.2):

- **Scores.** ``softmax``: p = softmax(u W_r^T) over the E experts (Switch Eq. 1).
  ``sigmoid`` (Eq. 15): s_i = sigmoid(u . e_i), each expert's affinity on its own.
- **Bias** (Eq. 16, "Auxiliary-Loss-Free Load Balancing"): a per-expert bias b_i is added to
  the scores *for the choice only*: the top-k experts of s_i + b_i; the gates are computed
  from the unbiased s_i of the chosen experts. After each training step
  b_i += gamma sign(mean_j load_j - load_i), load_i the assignments routed to expert i in the
  step over the whole global batch -- every rank and micro-batch, before any dropping --, so
  that b is the same on every rank (Megatron-Core all-reduces the counts over the ranks
  that route tokens: ``get_updated_expert_bias``). b is a float32 buffer, not trained: the
  model state ``router.expert_bias`` (``expert_bias_state``).
- **Group-limited routing** (Sec. 2.1.2, "Node-Limited Routing"): the E experts are cut into
  G groups of E/G consecutive experts; a group's score is the sum of the two highest
  (biased) scores of its experts; each token keeps the ``topk_groups`` groups of highest
  score and chooses its top-k among their experts only. (Megatron-Core's
  ``group_limited_topk`` sums the top k/topk_groups scores of a group instead; the two
  agree when k = 2 topk_groups, as in DeepSeek-V3: k = 8 of 4 groups.)
- **Gates** (Eq. 13): the chosen experts' scores normalised to sum 1 for the sigmoid router
  (k = 1: a gate of 1), and for the softmax router with k > 1 (GShard's top-2); the softmax
  router with k = 1 keeps the chosen probability (Switch).
- **Routed scaling** (DeepSeek-V3's ``routed_scaling_factor``, 2.5 in its released config;
  Megatron-Core's ``--moe-router-topk-scaling-factor``): the gates above, *after* their
  normalisation, times the factor ``scaling`` (1: none), so that they sum to the factor.
  Megatron-Core's ``topk_routing_with_score_function`` (megatron/core/transformer/moe/
  moe_utils.py) multiplies the final probabilities by it after either score function's
  normalisation (the sigmoid scores' division by their sum, the softmax over the top-k
  logits or the pre-softmax probabilities), before the gates weigh the experts' outputs;
  the balancing loss's scores are not scaled.
- **Scores of the balancing loss** (Eq. 19): the softmax probabilities; the sigmoid
  affinities normalised over all E experts, s_i / sum_j s_j.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

#: the name of the balancing bias buffer on a router (``blocks.{i}.mlp.router.expert_bias``)
BIAS_NAME = "expert_bias"


@dataclass(frozen=True)
class RouterRule:
    """How a router scores and chooses (module docstring): ``score`` softmax | sigmoid,
    ``groups`` G (0: not group-limited), ``topk_groups`` kept per token, ``scaling`` the
    routed gates' factor (1: none)."""

    score: str = "softmax"
    groups: int = 0
    topk_groups: int = 0
    scaling: float = 1.0


def rule_of(cfg) -> RouterRule:
    """The router rule of a model config."""
    return RouterRule(cfg.moe_router, cfg.moe_router_groups, cfg.moe_router_topk_groups,
                      cfg.moe_router_scaling)


def scores_of(logits: torch.Tensor, rule: RouterRule) -> torch.Tensor:
    """softmax(logits) or sigmoid(logits) over the experts (DeepSeek-V3 Eq. 15)."""
    if rule.score == "sigmoid":
        return torch.sigmoid(logits)
    return torch.softmax(logits, dim=-1)


def balance_scores(scores: torch.Tensor, rule: RouterRule) -> torch.Tensor:
    """The scores the balancing loss averages (DeepSeek-V3 Eq. 19: sigmoid affinities
    normalised over the experts; softmax probabilities as they are)."""
    if rule.score == "sigmoid":
        return scores / scores.sum(-1, keepdim=True)
    return scores


def balance_choice(scores: torch.Tensor, top_e: torch.Tensor, k: int, rule: RouterRule,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """``[T, k]``: the experts the balancing loss's f_i counts per token (DeepSeek-V3 Eq. 18:
    the top-k of the affinities themselves over all experts, no balancing bias, no group
    limit) -- without a bias or a group limit the routed ones ``top_e`` (GShard's and
    Switch's count)."""
    if bias is None and not rule.groups:
        return top_e
    return scores.topk(k, dim=-1).indices


def group_mask(choice: torch.Tensor, groups: int, topk_groups: int) -> torch.Tensor:
    """``[T, E]`` bool: the experts of each token's ``topk_groups`` groups of highest score,
    a group's score the sum of its top-2 entries of ``choice`` (DeepSeek-V3 Sec. 2.1.2)."""
    t, e = choice.shape
    per_group = choice.view(t, groups, e // groups)
    score = per_group.topk(2, dim=-1).values.sum(-1)  # [T, G]
    kept = score.topk(topk_groups, dim=-1).indices
    mask = torch.zeros(t, groups, dtype=torch.bool, device=choice.device)
    mask.scatter_(1, kept, True)
    return mask.unsqueeze(-1).expand(t, groups, e // groups).reshape(t, e)


def select(scores: torch.Tensor, k: int, rule: RouterRule,
           bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(experts ``[T, k]`` in choice order, gates ``[T, k]``): the top-k of scores + bias
    among the token's groups, gated by the unbiased scores, normalised, then times
    ``rule.scaling`` (module docstring)."""
    choice = scores if bias is None else scores + bias.to(scores.dtype)
    if rule.groups:
        choice = choice.masked_fill(~group_mask(choice, rule.groups, rule.topk_groups),
                                    float("-inf"))
    top_e = choice.topk(k, dim=-1).indices
    gates = scores.gather(1, top_e)
    if rule.score == "sigmoid" or k > 1:
        gates = gates / gates.sum(-1, keepdim=True)
    if rule.scaling != 1.0:
        gates = gates * rule.scaling
    return top_e, gates


def updated_bias(bias: torch.Tensor, load: torch.Tensor, rate: float) -> torch.Tensor:
    """b + gamma sign(mean(load) - load) (DeepSeek-V3 Sec. 2.1.2), per row of ``load``
    ``[..., E]`` (the global assignments of each expert in one step)."""
    load = load.to(bias.dtype)
    return bias + rate * torch.sign(load.mean(-1, keepdim=True) - load)


def add_bias_buffer(router: nn.Linear, num_experts: int) -> None:
    """Register the router's balancing bias (zeros, float32; ``BIAS_NAME``)."""
    router.register_buffer(BIAS_NAME, torch.zeros(num_experts, dtype=torch.float32))


def bias_of(router: nn.Module) -> torch.Tensor | None:
    """The router's balancing bias, or None when the model has none."""
    return getattr(router, BIAS_NAME, None)


def expert_bias_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every balancing bias of ``model`` by its global name (``blocks.{i}.mlp.router.
    expert_bias``): the model state beside the parameters the verdict compares."""
    return {n: b for n, b in model.named_buffers() if n.endswith(f".router.{BIAS_NAME}")}


def load_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy ``state`` (``expert_bias_state`` names) into ``model``'s biases."""
    with torch.no_grad():
        for n, b in expert_bias_state(model).items():
            b.copy_(state[n].to(b.device, b.dtype))
