"""``megatron_args=``: Megatron-LM's router arguments (issue 21) -- DeepSeek-V3's sigmoid score,
auxiliary-loss-free expert bias, group-limited routing and routed scaling factor applied; what parbench computes
differently refused with the reason. The expected values are Megatron-Core's semantics:
megatron/core/transformer/transformer_config.py (defaults, rules) and
megatron/core/transformer/moe/moe_utils.py (``topk_routing_with_score_function``,
``group_limited_topk``)."""
from __future__ import annotations

import json
import shlex

import pytest

from parbench.cli import main
from parbench.config import ConfigError
from parbench.imports import from_megatron_args, megatron_ignored, megatron_overrides

#: a tiny DeepSeek-V3-like model after examples/megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh:
#: first layer dense, fine-grained and shared experts, 8 experts in 4 groups of 2, top-4 of 2
#: groups (k / group_topk = 2, as DeepSeek-V3's 8 of 4)
TINY = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--vocab-size 128 --swiglu --normalization RMSNorm --disable-bias-linear "
        "--num-experts 8 --moe-layer-freq [0]*1+[1]*3 --moe-ffn-hidden-size 32 "
        "--moe-shared-expert-intermediate-size 32 --bf16 ")
ROUTER = ("--moe-router-topk 4 --moe-router-pre-softmax --moe-router-group-topk 2 "
          "--moe-router-num-groups 4 --moe-router-score-function sigmoid "
          "--moe-router-enable-expert-bias --moe-router-dtype fp32 "
          "--moe-shared-expert-overlap --moe-aux-loss-coeff 1e-4")
SIGMOID = TINY + "--moe-router-topk 4 --moe-router-score-function sigmoid "


def _model(text: str):
    return from_megatron_args(shlex.split(text)).model


def test_the_deepseek_v3_router_imports():
    m = _model(TINY + ROUTER)
    assert (m.moe_router, m.moe_top_k, m.moe_aux_loss_coef) == ("sigmoid", 4, 1e-4)
    assert (m.moe_router_groups, m.moe_router_topk_groups) == (4, 2)
    assert (m.moe_first_dense, m.moe_ffn_hidden_size, m.moe_shared_expert_size) == (1, 32, 32)
    # transformer_config.py: moe_router_bias_update_rate defaults to 1e-3
    assert m.moe_bias_update_rate == 1e-3
    assert megatron_ignored(shlex.split(TINY + ROUTER)) == [
        "--moe-router-dtype", "--moe-shared-expert-overlap", "--moe-router-pre-softmax"]


def test_the_bias_rate_is_read_with_the_bias_and_changes_nothing_without_it():
    with_bias = SIGMOID + "--moe-router-enable-expert-bias --moe-router-bias-update-rate 0.01"
    assert _model(with_bias).moe_bias_update_rate == 0.01
    alone = SIGMOID + "--moe-router-bias-update-rate 0.01"
    assert _model(alone).moe_bias_update_rate == 0.0
    assert megatron_ignored(shlex.split(alone)) == ["--moe-router-bias-update-rate"]


def test_the_group_count_without_group_topk_changes_nothing():
    text = SIGMOID + "--moe-router-num-groups 4"
    assert _model(text).moe_router_groups == 0
    assert megatron_ignored(shlex.split(text)) == ["--moe-router-num-groups"]


def test_the_topk_scaling_factor_scales_the_gates():
    """moe_utils.py, topk_routing_with_score_function: probs * scaling_factor after the
    normalisation (DeepSeek-V3's 2.5); absent or 0 (``if scaling_factor:``), not scaled."""
    assert _model(SIGMOID + "--moe-router-topk-scaling-factor 2.5").moe_router_scaling == 2.5
    assert _model(SIGMOID).moe_router_scaling == 1.0
    assert _model(SIGMOID + "--moe-router-topk-scaling-factor 0").moe_router_scaling == 1.0
    over = megatron_overrides(SIGMOID + "--moe-router-topk-scaling-factor 2.5")
    assert over["model.moe_router_scaling"] == "2.5"


def test_megatron_core_moe_defaults_when_left_out():
    """moe_router_topk 2, --moe-aux-loss-coeff 0.0, --moe-expert-capacity-factor None (no
    token dropped: parbench's 0)."""
    m = _model(TINY)
    assert (m.moe_top_k, m.moe_aux_loss_coef, m.moe_capacity_factor) == (2, 0.0, 0.0)
    assert m.moe_router == "softmax" and m.moe_bias_update_rate == 0.0


def test_softmax_top1_is_the_pre_softmax_switch_router():
    """With k = 1 pre-softmax routing gates with the chosen probability, parbench's Switch
    gate; without --moe-router-pre-softmax Megatron-Core refuses k = 1 under softmax."""
    m = _model(TINY + "--moe-router-topk 1 --moe-router-pre-softmax")
    assert (m.moe_router, m.moe_top_k) == ("softmax", 1)
    assert megatron_ignored(shlex.split(TINY + "--moe-router-topk 1 --moe-router-pre-softmax")) \
        == []


@pytest.mark.parametrize("text, match", [
    (TINY + "--moe-router-enable-expert-bias", "needs --moe-router-score-function sigmoid"),
    (TINY + "--moe-router-topk 1 --moe-router-score-function sigmoid",
     "gates with the sigmoid score itself"),
    (TINY + "--moe-router-topk 1", "needs --moe-router-pre-softmax"),
    (TINY + "--moe-router-topk 2 --moe-router-pre-softmax", "pre-softmax routing"),
    (SIGMOID + "--moe-router-group-topk 2", "needs --moe-router-num-groups"),
    (TINY + "--moe-router-topk 4 --moe-router-group-topk 2 --moe-router-num-groups 4",
     "picks the groups by the logits"),
    (SIGMOID + "--moe-router-group-topk 1 --moe-router-num-groups 4",
     "by its top 4 scores, parbench by its top 2"),
    (TINY + "--moe-router-score-function sqrtsoftplus", "sqrtsoftplus is not supported"),
    (SIGMOID + "--moe-router-frobnicate 1", "'--moe-router-frobnicate' is not supported"),
])
def test_what_parbench_computes_otherwise_is_refused_with_its_reason(text, match):
    with pytest.raises(ConfigError, match=match) as e:
        _model(text)
    assert "\n" not in str(e.value)


def test_estimate_states_the_router_and_run_gets_its_fields(capsys):
    scaled = TINY + ROUTER + " --moe-router-topk-scaling-factor 2.5"
    assert main(["estimate", "megatron_args=" + scaled, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)["inputs"]
    assert out["moe_router_scaling"] == 2.5
    assert (out["moe_router"], out["moe_bias_update_rate"]) == ("sigmoid", 1e-3)
    assert (out["moe_router_groups"], out["moe_router_topk_groups"]) == (4, 2)
    assert main(["estimate", "megatron_args=" + TINY, "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)["inputs"]
    assert not {"moe_router", "moe_bias_update_rate", "moe_router_groups",
                "moe_router_scaling"} & set(plain)
    over = megatron_overrides(TINY + ROUTER)
    assert (over["model.moe_router"], over["model.moe_bias_update_rate"]) == ("sigmoid", "0.001")
    assert (over["model.moe_router_groups"], over["model.moe_router_topk_groups"]) == ("4", "2")
