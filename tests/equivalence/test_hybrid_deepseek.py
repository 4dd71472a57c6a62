"""The hybrid on DeepSeek-V3's MoE blocks (issue 21; arXiv 2412.19437, Sec. 2.1.2):
``deepseek-tiny`` at 4 layers (the first dense), 8 fine-grained experts top-2 in 2 groups
keeping 1, the sigmoid router, one shared expert and the balancing bias, on tp 2 x ep 2 x pp 2
against the golden run -- parameters, gradients and the biases after every step -- with every
rank's wire bytes, calls and model states per axis equal to ``parbench.analytic.hybrid``;
``deepseek-v3-tiny`` (multi-head latent attention around the same MoE) under sp."""
from __future__ import annotations

import pytest

from parbench.config import ConfigError
from tests.equivalence.test_hybrid import assert_exact, make_case
from tests.helpers import run_on_pool

DEEPSEEK = {"model": "deepseek-tiny", "num_experts": 8, "num_layers": 4, "steps": 2,
            "timed_steps": 0}


def test_hybrid_runs_deepseek_moe_byte_exact(pools):
    case = make_case(**DEEPSEEK, tp=2, ep=2, etp=1, pp=2)
    merged, per_rank = run_on_pool(pools, case)
    assert_exact(case, merged, per_rank)
    # the bias update's loads: [L_moe of the stage, E] float32 over the stage's t cp d = 2
    # ranks, ring all-reduce 2 (n-1)/n B (stage 0 holds MoE layer 1, stage 1 layers 2, 3)
    for r in per_rank:
        moe = 1 if r.rank < 2 else 2  # ranks 0, 1: pp rank 0
        for wire in r.wire_by_axis_per_step:
            assert wire["tp_dp_cp"] == 2 * (2 - 1) / 2 * moe * 8 * 4, (r.rank, wire)


@pytest.mark.parametrize("ov, why", [
    ({"dtype": "bf16"}, "dtype='bf16'"),
    ({"schedule": "dualpipe", "num_microbatches": 4}, "two stage copies"),
])
def test_balancing_bias_refused_where_it_cannot_follow_the_golden_run(ov, why):
    with pytest.raises(ConfigError, match=why):
        make_case(**DEEPSEEK, tp=2, ep=2, etp=1, pp=2, **ov)


def test_hybrid_runs_mixtral_experts_byte_exact(pools):
    """mixtral-tiny (SwiGLU experts without biases, GQA, RoPE) on tp 2 x ep 2: the experts'
    [gate; up] fc1 and no biases in the closed form's states and gradient traffic."""
    case = make_case(model="mixtral-tiny", num_experts=8, steps=2, timed_steps=0, tp=2, ep=2,
                     etp=1)
    merged, per_rank = run_on_pool(pools, case)
    assert_exact(case, merged, per_rank)


def test_hybrid_runs_deepseek_v3_blocks_with_mla_byte_exact(pools):
    """deepseek-v3-tiny (MLA around DeepSeek's MoE) on tp 2 x ep 2 with sequence parallelism
    and a 8-wide query latent (so the latents' width w = 28 differs from h = 32): the down
    projections whole on every tp rank, their outputs all-gathered and their partial
    gradients in the once-per-step tp sum; bytes, calls and states as the closed form."""
    case = make_case(model="deepseek-v3-tiny", num_experts=8, steps=2, timed_steps=0, tp=2,
                     ep=2, etp=1, sp=True, q_lora_rank=8)
    merged, per_rank = run_on_pool(pools, case)
    assert_exact(case, merged, per_rank)


def test_hybrid_refuses_mla_with_selective_recomputation():
    with pytest.raises(ConfigError, match="recompute=selective with kv_lora_rank"):
        make_case(model="deepseek-v3-tiny", num_experts=8, tp=2, ep=2, etp=1,
                  recompute="selective")
