"""``expert.dropless`` (MegaBlocks) and ``expert.fastermoe`` (FasterMoE shadow experts) on real
gloo ranks against the golden run, with every rank's wire bytes and calls per axis equal to
``analytic.expert_dropless`` / ``analytic.expert_shadow`` (fed with the reference router's
counts) on every checked step; their MoE layers against ``parbench.model.moe.MoE`` on one process;
the checks that refuse bad input before spawning.

CI runs three fixed cases on 2 ranks; under the ``thorough`` profile Hypothesis draws the
degrees (up to 4 ranks), experts, top-k, layers, micro-batches, the router skew and the
number of shadows.
"""
from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from impls.expert.dropless import DroplessDispatch
from parbench.config import ConfigError, ModelConfig
from tests.equivalence.test_expert import make_case
from tests.helpers import moe_layer_against_reference, run_on_pool

THOROUGH = os.environ.get("HYPOTHESIS_PROFILE") == "thorough"


def assert_bytes_exact(case, per_rank) -> None:
    """Every rank's wire bytes and calls per axis equal the closed form's on every checked
    step, and the row's summed ep bytes equal the prediction's."""
    from parbench.registry import get_scheme
    pred = get_scheme(case.run.scheme).predict(case)
    for r in per_rank:
        for step, (wire, calls) in enumerate(zip(r.wire_by_axis_per_step,
                                                 r.calls_by_axis_per_step)):
            want_w, want_c = pred.wire_at(step)[r.rank], pred.calls_at(step)[r.rank]
            assert set(wire) | set(want_w) == set(want_w), (r.rank, wire, want_w)
            for axis in want_w:
                assert wire.get(axis, 0.0) == want_w[axis], (r.rank, step, axis, wire, want_w)
            assert {a: c for a, c in calls.items() if c} == want_c, (r.rank, step, calls)
        for states in r.model_states_per_step:
            assert states == pred.model_state_bytes[r.rank]
    m = per_rank[0].metrics
    assert m["ep_wire_bytes_all_ranks"] == m["ep_wire_bytes_all_ranks_predicted"]
    assert m["drop_fraction"] == 0.0


def check_case(pools, case) -> list:
    merged, per_rank = run_on_pool(pools, case)
    assert merged.equivalent, (merged.max_loss_abs, merged.max_grad_abs, merged.max_param_abs)
    assert not merged.uncovered
    assert_bytes_exact(case, per_rank)
    return per_rank


@pytest.mark.parametrize("scheme,ov", [
    ("expert.dropless", {"moe_top_k": 2, "moe_router_skew": 1, "num_microbatches": 2}),
    ("expert.fastermoe", {"moe_top_k": 2, "moe_shadow": 2, "moe_router_skew": 1})])
def test_dropless_and_shadow_match_golden_with_exact_bytes(pools, scheme, ov):
    """The CI cases: 4 experts on ep = dp = 2 (two local experts: the grouped computation
    permutes), top-2, a mildly skewed router."""
    check_case(pools, make_case(scheme, ep=2, dp=2, moe_capacity_factor=0, **ov))


@st.composite
def cases(draw):
    ep, dp = draw(st.sampled_from([(2, 2), (2, 4), (4, 4)]))
    experts = draw(st.sampled_from([e for e in (2, 4, 8) if e % ep == 0]))
    scheme = draw(st.sampled_from(["expert.dropless", "expert.fastermoe"]))
    extra = {"moe_shadow": draw(st.integers(0, min(experts, 2)))} \
        if scheme == "expert.fastermoe" else {}
    return make_case(
        scheme, ep=ep, dp=dp, num_experts=experts, moe_top_k=draw(st.integers(1, 2)),
        moe_capacity_factor=0, moe_router_skew=draw(st.sampled_from([0.0, 1.0, 2.0])),
        moe_every=draw(st.integers(1, 2)), num_layers=draw(st.integers(1, 2)),
        micro_batch_size=draw(st.integers(1, 2)), num_microbatches=draw(st.integers(1, 2)),
        **extra)


@settings(max_examples=40 if THOROUGH else 2)
@given(case=cases())
def test_drawn_cases_match_golden_with_exact_bytes(pools, case):
    check_case(pools, case)


def test_shadowing_cuts_the_all_to_all_on_a_skewed_router(pools):
    """FasterMoE's headline on our tiny case: with the most popular expert shadowed the
    token all-to-alls move fewer bytes than expert.dropless's on the same routing, which move
    fewer than expert.alltoall's padded buffers; the shadows' parameters cost more than that
    saves at this size (the measured total is above dropless's)."""
    case = make_case("expert.fastermoe", ep=2, dp=2, moe_capacity_factor=0, moe_shadow=1,
                     moe_router_skew=2, num_microbatches=2)
    m = check_case(pools, case)[0].metrics
    assert 0 < m["shadow_a2a_wire_bytes_all_ranks"] < m["dropless_a2a_wire_bytes_all_ranks"] \
        < m["alltoall_padded_ep_wire_bytes_all_ranks"]
    assert m["ep_wire_bytes_all_ranks"] > m["dropless_ep_wire_bytes_all_ranks"]
    load = [int(v) for v in m["tokens_routed_per_expert"].split("/")]
    assert load[0] == max(load)  # the skew makes expert 0 the popular one


@pytest.mark.parametrize("k,skew", [(1, 0.0), (2, 1.0), (2, 3.0)])
def test_dropless_layer_equals_the_reference_layer(k, skew):
    """One process, every expert local: the sorted, grouped computation of
    ``DroplessDispatch`` equals ``parbench.model.moe.MoE`` (output, input and every gradient)."""
    cfg = ModelConfig(num_experts=4, moe_top_k=k, moe_capacity_factor=0.0,
                      moe_z_loss_coef=1e-2, moe_router_skew=skew)
    stats, ref = moe_layer_against_reference(cfg, b=4, s=8,
                                             dispatch=DroplessDispatch(cfg, None, 1))
    assert stats["load"] == ref.last["load"].tolist() and sum(stats["dropped"]) == 0


def test_bad_input_fails_before_spawning():
    for scheme, ov, rule in [
            ("expert.dropless", {"ep": 2, "dp": 2, "moe_capacity_factor": 1.25},
             "moe_capacity_factor=1.25: expert.dropless is dropless"),
            ("expert.fastermoe", {"ep": 2, "dp": 2, "moe_capacity_factor": 1.0,
                                  "moe_shadow": 1}, "set moe_capacity_factor=0"),
            ("expert.fastermoe", {"ep": 2, "dp": 2, "moe_capacity_factor": 0,
                                  "moe_shadow": 5}, "moe_shadow=5: cannot shadow more"),
            ("baseline.deepspeed.moe", {"ep": 2, "dp": 2, "moe_capacity_factor": 0,
                                        "moe_router_skew": 1}, "moe_router_skew=1.0")]:
        with pytest.raises(ConfigError, match=rule) as err:
            make_case(scheme, **ov)
        assert "\n" not in str(err.value)
