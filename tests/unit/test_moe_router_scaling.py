"""The routed scaling factor (issue 21; DeepSeek-V3's ``routed_scaling_factor`` 2.5,
Megatron-Core's ``--moe-router-topk-scaling-factor``): the top-k gates, after their
normalisation, times the factor -- on hand-computed gates, in the golden model's MoE layer,
and refused by the baselines, which gate with their framework's own router."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from parbench.config import CaseConfig, ConfigError, model_preset, validate_case
from parbench.model import build_model
from parbench.model.moe import RoutingGroups
from parbench.model.router import RouterRule, select
from parbench.overrides import apply_overrides
from parbench.registry import get_scheme


def logit(p: float) -> float:
    return math.log(p / (1 - p))


def test_sigmoid_gates_are_normalised_then_scaled():
    """s = [0.5, 0.75, 0.25, 0.6]: top-2 = experts 1 and 3, normalised 0.75 / 1.35 = 5/9 and
    0.6 / 1.35 = 4/9, times 2.5 (so they sum to 2.5, not 1); k = 1: 1 x 2.5."""
    rule = RouterRule("sigmoid", scaling=2.5)
    s = torch.tensor([[0.5, 0.75, 0.25, 0.6]])
    top_e, gate = select(s, 2, rule)
    assert top_e.tolist() == [[1, 3]]
    torch.testing.assert_close(gate, torch.tensor([[2.5 * 5 / 9, 2.5 * 4 / 9]]))
    torch.testing.assert_close(select(s, 1, rule)[1], torch.tensor([[2.5]]))


def test_softmax_switch_gate_is_scaled():
    """Softmax top-1 (Switch): p = softmax([0, ln 3]) = [1/4, 3/4], gate 3/4 x 2."""
    p = torch.softmax(torch.tensor([[0.0, math.log(3.0)]]), -1)
    top_e, gate = select(p, 1, RouterRule(scaling=2.0))
    assert top_e.tolist() == [[1]]
    torch.testing.assert_close(gate, torch.tensor([[1.5]]))


def test_golden_moe_layer_weighs_the_experts_by_the_scaled_gates():
    """deepseek-tiny with moe_router_scaling=2.5, one token x = e_0 and a router whose first
    column gives the affinities [0.9, 0.1, 0.1, 0.1 | 0.62, 0.6, 0.1, 0.1]: the group of the
    top-2 sum 1.22 is kept, experts 4 and 5 gated 2.5 x 0.62 / 1.22 and 2.5 x 0.6 / 1.22,
    plus the shared expert."""
    cfg = replace(model_preset("deepseek-tiny"), moe_router_scaling=2.5)
    moe = build_model(cfg, 3, RoutingGroups(rows=1)).blocks["1"].mlp
    probs = (0.9, 0.1, 0.1, 0.1, 0.62, 0.6, 0.1, 0.1)
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[:, 0] = torch.tensor([logit(p) for p in probs])
    x = torch.zeros(1, 1, cfg.hidden_size)
    x[0, 0, 0] = 1.0
    with torch.no_grad():
        y = moe(x)
        want = (moe.shared_expert(x) + 2.5 * 0.62 / 1.22 * moe.experts[4](x)
                + 2.5 * 0.6 / 1.22 * moe.experts[5](x))
    torch.testing.assert_close(y, want)


@pytest.mark.parametrize("scheme", ["baseline.deepspeed.moe", "baseline.megatron.moe"])
def test_schemes_that_gate_otherwise_refuse_the_factor(scheme):
    """A softmax top-2 MoE model with only the factor set: refused before spawning, naming
    the field and its value."""
    case = apply_overrides(CaseConfig(), {"scheme": scheme, "num_experts": "4",
                                          "moe_top_k": "2", "moe_router_scaling": "2.5",
                                          "micro_batch_size": "2", "dp": "2", "ep": "2"})
    validate_case(case)
    with pytest.raises(ConfigError, match=r"moe_router_scaling=2\.5: baseline "
                                          f"{scheme.replace('.', '[.]')} routes with its"):
        get_scheme(scheme).check(case)


def test_the_factor_must_be_positive_and_needs_an_moe_model():
    with pytest.raises(ConfigError, match="moe_router_scaling=0.0 must be > 0"):
        validate_case(apply_overrides(CaseConfig(), {"num_experts": "4",
                                                     "moe_router_scaling": "0"}))
    with pytest.raises(ConfigError, match="moe_router_scaling=2.5 needs an MoE model"):
        validate_case(apply_overrides(CaseConfig(), {"moe_router_scaling": "2.5"}))
