"""The DeepSeek-V3 router rules (arXiv 2412.19437, Sec. 2.1.2) on hand-computed examples --
sigmoid affinities and normalised gates, the balancing bias in the choice only, its update
from the load, group-limited routing by the top-2 sum -- the DeepSeek-style MoE layer (shared
expert, fine-grained experts, first layers dense), the fields' rules, and the closed forms'
parameter, state and traffic counts against the model."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from parbench.analytic.expert import bias_traffic, rank_states, rank_tensors
from parbench.analytic.shape import shape_from
from parbench.config import (ANALYTIC_ONLY_FIELDS, CaseConfig, ConfigError, ModelConfig,
                             model_preset, validate_case)
from parbench.golden.store import from_tensors, to_tensors
from parbench.model import build_model
from parbench.model.moe import (MoE, RoutingGroups, combine_reference, is_moe_layer, route,
                                update_expert_bias)
from parbench.model.router import (RouterRule, balance_scores, expert_bias_state, group_mask,
                                   scores_of, select, updated_bias)

SIGMOID = RouterRule("sigmoid")


def logit(p: float) -> float:
    return math.log(p / (1 - p))


def test_sigmoid_affinities_and_normalised_gates():
    """s = sigmoid(u): [0.5, 0.75, 0.25, 0.6]; top-2 = experts 1 and 3, gates 0.75 / 1.35 and
    0.6 / 1.35 (Eq. 13); the balancing loss's scores are s / sum s (Eq. 19)."""
    s = scores_of(torch.tensor([[logit(p) for p in (0.5, 0.75, 0.25, 0.6)]]), SIGMOID)
    torch.testing.assert_close(s, torch.tensor([[0.5, 0.75, 0.25, 0.6]]))
    top_e, gate = select(s, 2, SIGMOID)
    assert top_e.tolist() == [[1, 3]]
    torch.testing.assert_close(gate, torch.tensor([[5 / 9, 4 / 9]]))
    torch.testing.assert_close(balance_scores(s, SIGMOID), s / 2.1)
    _, one = select(s, 1, SIGMOID)
    assert one.tolist() == [[1.0]]  # k = 1: the normalised gate is 1


def test_bias_steers_the_choice_not_the_gates():
    """b = [0, -0.3, 0, 0]: s + b = [0.5, 0.45, 0.25, 0.6] -> experts 3 and 0, gated by the
    unbiased s: 0.6 / 1.1 and 0.5 / 1.1."""
    s = torch.tensor([[0.5, 0.75, 0.25, 0.6]])
    top_e, gate = select(s, 2, SIGMOID, torch.tensor([0.0, -0.3, 0.0, 0.0]))
    assert top_e.tolist() == [[3, 0]]
    torch.testing.assert_close(gate, torch.tensor([[6 / 11, 5 / 11]]))


def test_bias_update_moves_against_the_load():
    """load [3, 1, 2, 2], mean 2: the overloaded expert 0 loses gamma, the underloaded 1
    gains it, the others stay."""
    out = updated_bias(torch.zeros(4), torch.tensor([3, 1, 2, 2]), 0.001)
    torch.testing.assert_close(out, torch.tensor([-0.001, 0.001, 0.0, 0.0]))


def test_group_limited_routing_by_top2_sum_not_max():
    """Group A = [0.9, 0.1, 0.1, 0.1] (max 0.9, top-2 sum 1.0), group B = [0.62, 0.6, 0.1,
    0.1] (max 0.62, top-2 sum 1.22): DeepSeek-V3 keeps B, so the top-2 are experts 4 and 5
    (a max rule would keep A and expert 0)."""
    s = torch.tensor([[0.9, 0.1, 0.1, 0.1, 0.62, 0.6, 0.1, 0.1]])
    rule = RouterRule("sigmoid", groups=2, topk_groups=1)
    assert group_mask(s, 2, 1).tolist() == [[False] * 4 + [True] * 4]
    top_e, gate = select(s, 2, rule)
    assert top_e.tolist() == [[4, 5]]
    torch.testing.assert_close(gate, torch.tensor([[0.62 / 1.22, 0.6 / 1.22]]))


def test_softmax_rule_is_unchanged():
    """The default rule: top-k of softmax; k = 2 renormalised, k = 1 the probability."""
    logits = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    p = torch.softmax(logits, -1)
    top_p, top_e = p.topk(2, -1)
    e, g = select(scores_of(logits, RouterRule()), 2, RouterRule())
    assert torch.equal(e, top_e) and torch.equal(g, top_p / top_p.sum(-1, keepdim=True))
    e, g = select(p, 1, RouterRule())
    assert torch.equal(g, p.max(-1, keepdim=True).values)


def test_moe_layer_adds_the_shared_expert_and_tracks_the_step_load():
    cfg = model_preset("deepseek-tiny")
    moe = build_model(cfg, 3, RoutingGroups(rows=2)).blocks["1"].mlp
    assert isinstance(moe, MoE) and moe.experts[0].fc1.weight.shape == (16, 32)
    x = torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(1))
    y = moe(x)
    xt = x.transpose(0, 1).reshape(8, 32)
    r = route(xt, moe.router.weight, RoutingGroups(rows=2).ids(2, 4), 2, 0.0, 0.0, 0.0,
              rule=RouterRule("sigmoid", 2, 1), bias=moe.router.expert_bias)
    want = combine_reference(xt, r, moe.experts) + moe.shared_expert(xt)
    torch.testing.assert_close(y, want.view(4, 2, 32).transpose(0, 1))
    assert int(moe.step_load.sum()) == 16  # 8 tokens x top-2
    load = moe.step_load.clone()
    update_expert_bias(moe)
    torch.testing.assert_close(moe.router.expert_bias, updated_bias(torch.zeros(8), load, 1e-3))
    assert int(moe.step_load.sum()) == 0


def test_first_dense_layers_and_the_shape_agree():
    cfg = replace(model_preset("deepseek-tiny"), num_layers=6, moe_first_dense=2, moe_every=2)
    shape = shape_from(cfg)
    assert [is_moe_layer(cfg, i) for i in range(6)] == [shape.is_moe_layer(i)
                                                         for i in range(6)]
    assert [is_moe_layer(cfg, i) for i in range(6)] == [False, False, True, False, True,
                                                         False]


def test_closed_forms_count_the_model():
    """Parameters (dense with the shared expert, fine-grained experts), the biases' state and
    the loads' all-reduce."""
    cfg = model_preset("deepseek-tiny")
    model = build_model(cfg, 0, RoutingGroups(rows=1))
    dense, expert = rank_tensors(shape_from(cfg), ep=1)
    params = dict(model.named_parameters())
    assert sum(dense) == sum(p.numel() for n, p in params.items() if ".experts." not in n)
    assert sum(expert) == sum(p.numel() for n, p in params.items() if ".experts." in n)
    assert len(dense) + len(expert) == len(params)
    assert rank_states(shape_from(cfg), 1)["other"] == 2 * 8 * 4
    assert sorted(expert_bias_state(model)) == ["blocks.1.mlp.router.expert_bias",
                                                "blocks.2.mlp.router.expert_bias"]
    (t,) = bias_traffic(shape_from(cfg), dp=4)
    assert (t.axis, t.op, t.count, t.message_bytes) == ("dp", "all_reduce", 1, 2 * 8 * 4)
    assert bias_traffic(shape_from(cfg), dp=1)[0].count == 0
    assert bias_traffic(shape_from(replace(cfg, moe_bias_update_rate=0.0)), dp=4) == []


def test_golden_file_keeps_the_state():
    from parbench.golden.run import GoldenRun
    run = GoldenRun([1.0], [{"w": torch.ones(2)}], [{"w": torch.ones(2)}],
                    states=[{"blocks.1.mlp.router.expert_bias": torch.tensor([0.001, -0.001])}])
    back = from_tensors(to_tensors(run))
    assert torch.equal(back.states[0]["blocks.1.mlp.router.expert_bias"],
                       run.states[0]["blocks.1.mlp.router.expert_bias"])


def test_fields_run_and_their_rules():
    assert not {"moe_ffn_hidden_size", "moe_shared_expert_size",
                "moe_first_dense"} & set(ANALYTIC_ONLY_FIELDS)
    validate_case(CaseConfig(model=model_preset("deepseek-tiny")))
    base = model_preset("deepseek-tiny")
    bad = [({"moe_router": "relu"}, "moe_router='relu' must be one of softmax, sigmoid"),
           ({"moe_router_groups": 3}, "moe_router_groups=3 does not divide num_experts=8"),
           ({"moe_router_groups": 8}, "each group needs at least 2"),
           ({"moe_router_topk_groups": 3}, r"moe_router_topk_groups=3 must be in \[1, "),
           ({"moe_router_groups": 0}, "moe_router_topk_groups=1 needs moe_router_groups"),
           ({"moe_top_k": 5}, "moe_top_k=5 exceeds the 4 experts"),
           ({"moe_first_dense": 3}, "moe_first_dense=3 leaves no MoE layer"),
           ({"num_experts": 0, "moe_router_groups": 0, "moe_router_topk_groups": 0},
            r"moe_ffn_hidden_size=16 needs an MoE model")]
    for change, msg in bad:
        with pytest.raises(ConfigError, match=msg):
            validate_case(CaseConfig(model=replace(base, **change)))
    assert ModelConfig().moe_features() == {}
    assert set(base.moe_features()) == {"fine-grained", "shared-expert", "first-dense",
                                        "sigmoid-router", "expert-bias", "group-limited"}


def test_the_balancing_loss_counts_the_unbiased_top_k_over_all_experts():
    """DeepSeek-V3 Eq. 18: f_i = N_r / (K_r T) sum_t 1(s_it in TopK({s_jt}, K_r)) -- the top-k
    of the affinities s themselves (no balancing bias, no group limit), while the routed
    experts are chosen with both (Eq. 16, Sec. 2.1.2). With a bias that moves every token to
    other experts, f is still the unbiased count: the loss is N sum_i f_i P_i with
    P_i = mean_t s'_it (Eq. 19-20), computed here by hand."""
    import torch
    from parbench.model.moe import route
    from parbench.model.router import RouterRule
    torch.manual_seed(0)
    T, h, E, k = 6, 4, 4, 1  # noqa: N806
    x, w = torch.randn(T, h), torch.randn(E, h)
    rule = RouterRule(score="sigmoid", groups=2, topk_groups=1)
    scores = torch.sigmoid(x @ w.t())
    bias = torch.full((E,), 10.0)
    bias[scores.argmax(-1)] = -10.0  # every token routed away from its best expert
    r = route(x, w, torch.zeros(T, dtype=torch.long), k, 0.0, 1.0, 0.0, rule=rule, bias=bias)
    assert (r.expert[:, 0] != scores.argmax(-1)).all()
    f = torch.bincount(scores.argmax(-1), minlength=E).float() / (T * k)
    p = (scores / scores.sum(-1, keepdim=True)).mean(0)
    assert r.stats["aux_loss"] == pytest.approx(float(E * (f * p).sum()), rel=1e-6)
