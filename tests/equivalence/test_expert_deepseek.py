"""DeepSeek-V3-style MoE blocks (arXiv 2412.19437, Sec. 2.1.2) in the native expert family on
real gloo ranks: the ``deepseek-tiny`` preset (first layer dense, fine-grained routed experts,
a shared expert, the sigmoid router with the auxiliary-loss-free balancing bias, group-limited
routing; ``deepseek-v3-tiny`` adds multi-head latent attention) against the golden run --
loss, gradients, parameters and the routers' biases after every step (the stepwise golden's update from the global load) -- with every rank's wire
bytes, calls and model states equal to the closed forms (the loads' all-reduce over dp and
the biases' 4 E L_moe bytes included); and the schemes that do not run these features refuse
them before spawning.
"""
from __future__ import annotations

import pytest

from parbench.config import CaseConfig, ConfigError, validate_case
from parbench.overrides import apply_overrides
from parbench.registry import get_scheme
from tests.equivalence.test_expert import assert_exact, make_case
from tests.equivalence.test_expert_dropless import assert_bytes_exact
from tests.helpers import run_on_pool

#: the preset's MoE shape, restated because the suite-style make_case sets num_experts
DEEPSEEK = {"model": "deepseek-tiny", "num_experts": 8, "steps": 3, "timed_steps": 1}


def deepseek_case(scheme: str = "expert.alltoall", **ov):
    return make_case(scheme, **{**DEEPSEEK, **ov})


def assert_equivalent_with_bias(merged, per_rank) -> None:
    assert merged.equivalent, merged.first_failure
    assert not merged.uncovered
    assert merged.final_ok, merged.first_failure
    for r in per_rank:
        checked = [c for c in r.checks if c.state_ok is not None]
        assert len(checked) == len(r.checks) and all(c.state_ok for c in checked)


def test_alltoall_runs_deepseek_tiny_with_exact_bytes(pools):
    """ep = dp = 2, 2 micro-batches: 4 routed experts per rank, the shared expert and the
    bias replicated; the bias moves every step and equals the golden model's update."""
    case = deepseek_case(ep=2, dp=2, num_microbatches=2)
    merged, per_rank = run_on_pool(pools, case)
    assert_equivalent_with_bias(merged, per_rank)
    assert_exact(case, per_rank)


def test_dropless_runs_deepseek_tiny_at_ep4(pools):
    """expert.dropless at ep = dp = 4 (two experts per rank; uneven all-to-alls), the counts
    of the closed form from the reference router with the golden biases."""
    case = deepseek_case("expert.dropless", ep=4, dp=4, micro_batch_size=1)
    merged, per_rank = run_on_pool(pools, case)
    assert_equivalent_with_bias(merged, per_rank)
    assert_bytes_exact(case, per_rank)


def test_alltoall_runs_the_routed_scaling_factor(pools):
    """moe_router_scaling=2.5 (DeepSeek-V3's routed_scaling_factor) at ep = dp = 2: the gates
    times 2.5 after their normalisation, equal to the golden run step by step."""
    case = deepseek_case(ep=2, dp=2, moe_router_scaling=2.5)
    assert case.model.moe_router_scaling == 2.5
    merged, per_rank = run_on_pool(pools, case)
    assert_equivalent_with_bias(merged, per_rank)
    assert_exact(case, per_rank)


def test_alltoall_runs_deepseek_v3_tiny_with_mla(pools):
    """deepseek-v3-tiny (DeepSeek-V3's blocks: multi-head latent attention in the dense part,
    the DeepSeek MoE with SwiGLU experts, no biases, routed scaling 2.5) at ep = dp = 2: the
    latents and the bias equal to the golden run's every step, every rank's bytes, calls
    and states equal to the closed forms (the MLA tensors counted by analytic.mla)."""
    case = make_case("expert.alltoall", model="deepseek-v3-tiny", num_experts=8, ep=2, dp=2,
                     num_microbatches=2, steps=3, timed_steps=1)
    assert case.model.kv_lora_rank and case.model.moe_router_scaling == 2.5
    merged, per_rank = run_on_pool(pools, case)
    assert_equivalent_with_bias(merged, per_rank)
    assert_exact(case, per_rank)


@pytest.mark.parametrize("scheme,exact", [("expert.alltoall", assert_exact),
                                          ("expert.dropless", assert_bytes_exact)])
def test_the_expert_family_runs_mixtral_blocks(pools, scheme, exact):
    """mixtral-tiny (Jiang et al. 2024): 8 SwiGLU experts without biases, top-2, GQA, RoPE,
    RMSNorm at ep = dp = 2 -- equal to the golden run, every rank's bytes, calls and states
    equal to the closed forms (the experts' [gate; up] fc1 counted)."""
    case = make_case(scheme, model="mixtral-tiny", num_experts=8, ep=2, dp=2, steps=3,
                     timed_steps=1)
    merged, per_rank = run_on_pool(pools, case)
    assert merged.equivalent, merged.first_failure
    exact(case, per_rank)


def test_framework_moe_baselines_refuse_mixtral_experts():
    case = apply_overrides(CaseConfig(), {"scheme": "baseline.deepspeed.moe",
                                          "model": "mixtral-tiny", "dp": "2", "ep": "2"})
    validate_case(case)
    with pytest.raises(ConfigError, match="does not run this LLaMA-style feature"):
        get_scheme("baseline.deepspeed.moe").check(case)


@pytest.mark.parametrize("scheme,want", [
    ("baseline.deepspeed.moe", "moe_ffn_hidden_size=16: baseline baseline.deepspeed.moe "
                               "routes with its framework"),
])
def test_schemes_without_the_features_refuse_them(scheme, want):
    """Before spawning, naming the field and its value."""
    gpt2_blocks = {"rope_theta": "0", "position_embeddings": "true", "norm": "layernorm"}
    case = apply_overrides(CaseConfig(), {"scheme": scheme, "model": "deepseek-tiny",
                                          "micro_batch_size": "2", "dp": "2", "ep": "2",
                                          **gpt2_blocks})
    validate_case(case)
    with pytest.raises(ConfigError, match=want):
        get_scheme(scheme).check(case)
