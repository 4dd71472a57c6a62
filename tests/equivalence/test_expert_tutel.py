"""``expert.tutel`` on real gloo ranks: golden-equivalent in every mode (ep, dp, adaptive) and
all-to-all (flat, 2-D), with every rank's wire bytes, calls and model states equal to
``analytic.expert_tutel`` on every checked step, and the capacities and modes of the last
step equal to the closed form's (capacity from the reference router's counts).

The CI cases are fixed (one per mode, one on 4 ranks with the 2-D all-to-all); Hypothesis
draws more under the ``thorough`` profile only.
"""
from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parbench.config import CaseConfig, ConfigError, validate_case
from parbench.overrides import apply_overrides
from parbench.registry import get_scheme
from tests.helpers import assert_wire_and_calls_per_step, run_on_pool


def make_case(**ov) -> CaseConfig:
    base = {"scheme": "expert.tutel", "model": "tiny", "num_experts": "4", "steps": "2",
            "timed_steps": "0", "micro_batch_size": "2", "num_microbatches": "2",
            "moe_capacity_factor": "0"}
    case = apply_overrides(CaseConfig(), {**base, **{k: str(v) for k, v in ov.items()}})
    validate_case(case)
    get_scheme("expert.tutel").check(case)
    return case


def check_exact(case, merged, per_rank) -> dict:
    """Equivalent; bytes, calls and states equal the closed form per rank and step; rank 0's
    last-step capacities and modes equal the prediction's. Returns the prediction's
    figures."""
    assert merged.equivalent, (merged.max_loss_abs, merged.max_grad_abs, merged.max_param_abs)
    assert not merged.uncovered
    pred = get_scheme("expert.tutel").predict(case)
    for r in per_rank:
        for step, states in enumerate(r.model_states_per_step):
            assert states == pred.states_at(step)[r.rank], (r.rank, states)
    assert_wire_and_calls_per_step(pred, per_rank)
    rank0 = next(r for r in per_rank if r.rank == 0)
    fig = pred.figures
    assert rank0.metrics["capacity_per_layer_microbatch"] == fig["capacity_per_step_rank0"][-1]
    assert rank0.metrics["mode_per_layer_microbatch"] == fig["mode_per_step_rank0"][-1]
    return fig


@pytest.mark.parametrize("ov", [
    {"ep": 2, "dp": 2},
    {"ep": 2, "dp": 2, "moe_mode": "dp", "moe_top_k": 2, "moe_capacity_factor": 1.0},
    {"ep": 2, "dp": 2, "moe_mode": "adaptive", "ffn_hidden_size": 12},
    {"ep": 4, "dp": 4, "moe_mode": "adaptive", "moe_a2a": "2d", "ffn_hidden_size": 16},
], ids=["ep-flat", "dp-top2-bounded", "adaptive-flat", "adaptive-2d-ep4"])
def test_tutel_matches_golden_with_exact_bytes(pools, ov):
    case = make_case(**ov)
    merged, per_rank = run_on_pool(pools, case)
    fig = check_exact(case, merged, per_rank)
    modes = {m for step in fig["mode_per_step_rank0"] for m in step}
    if ov.get("moe_mode") == "adaptive":
        assert modes == {"ep", "dp"}  # the case is chosen so that the rule switches
    if ov.get("moe_capacity_factor") != 1.0:  # unbounded: smaller than the static buffer
        assert fig["buffer_bytes_adaptive_mean_rank0"] < fig["buffer_bytes_static"]


@st.composite
def cases(draw):
    ep, dp = draw(st.sampled_from([(1, 2), (2, 2), (2, 4), (4, 4)]))
    return make_case(
        ep=ep, dp=dp, moe_mode=draw(st.sampled_from(["ep", "dp", "adaptive"])),
        moe_a2a=draw(st.sampled_from(["flat", "2d"])) if ep % 2 == 0 else "flat",
        num_experts=draw(st.sampled_from([e for e in (4, 8) if e % ep == 0])),
        moe_top_k=draw(st.integers(1, 2)),
        moe_capacity_factor=draw(st.sampled_from([0.0, 1.0, 1.25])),
        ffn_hidden_size=draw(st.sampled_from([12, 16, 128])),
        moe_every=draw(st.integers(1, 2)), num_microbatches=draw(st.integers(1, 2)))


@settings(max_examples=100 if os.environ.get("HYPOTHESIS_PROFILE") == "thorough" else 2)
@given(case=cases())
def test_tutel_drawn_cases(pools, case):
    merged, per_rank = run_on_pool(pools, case)
    check_exact(case, merged, per_rank)


def test_bad_input_fails_before_spawning():
    with pytest.raises(ConfigError, match="ep=1 with moe_a2a=2d"):
        make_case(ep=1, dp=2, moe_a2a="2d")
    with pytest.raises(ConfigError, match="moe_mode='both' must be one of"):
        make_case(ep=2, dp=2, moe_mode="both")
    with pytest.raises(ConfigError, match="fp32 only"):
        make_case(ep=2, dp=2, dtype="bf16")
