"""The five-axis hybrid on real gloo ranks: against the golden run (the golden MoE routes the
same groups), with every rank's wire bytes, calls and model states per axis equal to the
closed form of ``parbench.analytic.hybrid`` on every checked step.

Hypothesis draws a world-4 layout (two of tp / cp / dp / pp at 2, ep over the stage's ranks),
sequence parallelism, the cp attention, recomputation, the schedule (fused, split-backward
and bidirectional ones), and the MoE settings
(experts, top-k, capacity with dropping, every-other-layer MoE). Every example runs on the
session's 4-rank pool.
"""
from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from parbench.config import CaseConfig, ConfigError, validate_case
from parbench.overrides import apply_overrides
from parbench.registry import get_scheme
from tests.equivalence.test_tensor import PARAM_ATOL
from tests.helpers import run_on_pool


def make_case(**ov) -> CaseConfig:
    base = {"scheme": "hybrid", "model": "tiny-4l", "vocab_size": 61, "steps": 2,
            "timed_steps": 0, "micro_batch_size": 2, "num_microbatches": 2,
            "param_atol": PARAM_ATOL}
    base.update(ov)
    case = apply_overrides(CaseConfig(), {k: str(v).lower() if isinstance(v, bool) else str(v)
                                          for k, v in base.items()})
    validate_case(case)
    get_scheme("hybrid").check(case)
    return case


def assert_exact(case, merged, per_rank):
    assert merged.equivalent, (f"loss {merged.max_loss_abs:.3g} grad {merged.max_grad_abs:.3g} "
                               f"param {merged.max_param_abs:.3g} {merged.uncovered[:3]}")
    pred = get_scheme("hybrid").predict(case)
    for r in per_rank:
        for states in r.model_states_per_step:
            assert states == pred.model_state_bytes[r.rank], (r.rank, states)
        for step, (wire, calls) in enumerate(zip(r.wire_by_axis_per_step,
                                                 r.calls_by_axis_per_step)):
            assert {a: w for a, w in wire.items() if w} == pred.wire_at(step)[r.rank]
            assert {a: c for a, c in calls.items() if c} == pred.calls_at(step)[r.rank]


layouts = st.sampled_from([
    {"tp": 2, "pp": 2}, {"tp": 2, "cp": 2}, {"tp": 2, "dp": 2}, {"cp": 2, "pp": 2},
    {"dp": 2, "pp": 2}, {"cp": 2, "dp": 2},
])


@given(lay=layouts, sp=st.booleans(), kind=st.sampled_from(["allgather", "ring-attention",
                                                            "ulysses"]),
       recompute=st.sampled_from(["none", "selective", "full"]),
       schedule=st.sampled_from(["1f1b", "gpipe", "interleaved", "zb-h1", "zbv", "chimera",
                                 "dualpipev"]),
       experts=st.sampled_from([0, 4]), top_k=st.integers(1, 2),
       cf=st.sampled_from([0.0, 1.0, 1.5]), every=st.integers(1, 2), ep=st.sampled_from([1, 2]),
       zero=st.integers(0, 3))
@settings(max_examples=6, deadline=None)
def test_hybrid_matches_golden_with_exact_bytes(pools, lay, sp, kind, recompute, schedule,
                                                experts, top_k, cf, every, ep, zero):
    ov = dict(lay, sp=sp and lay.get("tp", 1) > 1, cp_algorithm=kind,
              recompute=recompute,
              schedule=schedule if lay.get("pp", 1) > 1 else "1f1b", zero_stage=zero)
    if schedule in ("interleaved", "zbv", "dualpipev") and lay.get("pp", 1) > 1:
        ov.update(vpp=2)
    if experts:
        ov.update(num_experts=experts, moe_top_k=top_k, moe_capacity_factor=cf,
                  moe_every=every, ep=ep, etp=1, moe_z_loss_coef=1e-3)
    try:
        case = make_case(**ov)
    except ConfigError:
        assume(False)
    merged, per_rank = run_on_pool(pools, case)
    assert_exact(case, merged, per_rank)


def test_moe_routing_drops_tokens_and_the_golden_agrees(pools):
    """Capacity 1.0 with top-2 on 4 experts drops assignments, and the run still equals the
    golden run that routes the same groups; the row reports the drops."""
    case = make_case(tp=2, dp=2, ep=2, etp=1, num_experts=4, moe_top_k=2,
                     moe_capacity_factor=1.0)
    merged, per_rank = run_on_pool(pools, case)
    assert_exact(case, merged, per_rank)
    assert sum(sum(r.metrics["moe_dropped_per_expert"]) for r in per_rank) > 0


def test_moe_routed_scaling_factor_matches_the_golden_run(pools):
    """moe_router_scaling=2.5 (DeepSeek-V3's routed_scaling_factor): the top-2 gates times
    2.5 in every MoE layer under tp x ep x dp, equal to the golden run."""
    case = make_case(tp=2, dp=2, ep=2, etp=1, num_experts=4, moe_top_k=2,
                     moe_router_scaling=2.5)
    assert case.model.moe_router_scaling == 2.5
    merged, per_rank = run_on_pool(pools, case)
    assert_exact(case, merged, per_rank)


@pytest.mark.parametrize("ov", [
    {"tp": 2, "pp": 2, "sp": True, "schedule": "zb-h2", "recompute": "full",
     "num_microbatches": 4},
    {"tp": 2, "pp": 2, "ep": 2, "etp": 1, "num_experts": 4, "schedule": "chimera",
     "num_microbatches": 4},
], ids=["zb-h2-sp-full-recompute", "chimera-moe"])
def test_split_backward_and_two_replica_schedules(pools, ov):
    """A split backward moves the bytes of a fused one (the tp linears do only B's or W's
    part); Chimera's two stage copies add the partner's gradients and agree bit for bit."""
    case = make_case(**ov)
    merged, per_rank = run_on_pool(pools, case)
    assert_exact(case, merged, per_rank)


# bf16: losses and gradients held to the tolerances derived from each step's rounding noise
# (parbench.verdict.precision), and so are the final parameters after the timed steps (the
# continuation in bf16 against fp32); param_atol, 2 * lr per timed step, bounds the drift shown
# (a larger one cannot fail and is refused: parbench.tolerance_rules.adamw_max_divergence)
BF16 = {"dtype": "bf16", "param_atol": 4e-3}


@pytest.mark.parametrize("ov", [
    {"dp": 2, "pp": 2, "zero_stage": 1},
    {"cp": 2, "dp": 2, "zero_stage": 2, **BF16},
    {"tp": 2, "dp": 2, "ep": 2, "etp": 1, "num_experts": 4, "zero_stage": 3},
    {"dp": 2, "pp": 2, "zero_stage": 3, **BF16},
], ids=["zero1-pp", "zero2-cp-bf16", "zero3-moe", "zero3-pp-bf16"])
def test_zero_stages_over_dp_cp_and_edp(pools, ov):
    """ZeRO 1-3 over the dense (dp x cp) and expert (edp) gradient groups: the golden run's
    numbers (bf16 at the tolerances derived from its rounding noise), one reduce-scatter and one all-gather of
    the padded buffer per group, and the sharded states of the closed form on every rank."""
    case = make_case(**ov)
    merged, per_rank = run_on_pool(pools, case)
    assert_exact(case, merged, per_rank)


def test_hybrid_clips_by_the_global_norm(pools):
    """``clip_grad=0.5`` clips every checked step of tp x dp x ep with ZeRO-1: tp duplicates
    counted on one tp rank, the dense and expert shards summed over dp x cp and edp, the
    experts over ep -- the golden run's clipped numbers, and one 4-byte all-reduce per spread
    axis in the closed form."""
    ov = {"tp": 2, "dp": 2, "ep": 2, "etp": 1, "num_experts": 4, "zero_stage": 1}
    case = make_case(**ov, clip_grad=0.5)
    merged, per_rank = run_on_pool(pools, case)
    assert_exact(case, merged, per_rank)
    assert merged.clipped_steps == case.run.steps and merged.clip_coef_min < 1.0
    plain = get_scheme("hybrid").predict(make_case(**ov)).calls_at(0)[0]
    calls = get_scheme("hybrid").predict(case).calls_at(0)[0]
    assert {a: calls[a] - plain.get(a, 0) for a in calls} == \
        {"tp": 1, "dp_cp": 1, "ep": 1, "edp": 1, **{a: 0 for a in calls
                                                  if a not in ("tp", "dp_cp", "ep", "edp")}}


@pytest.mark.parametrize("ov, msg", [
    ({"tp": 2, "ep": 2, "num_experts": 4, "dp": 2}, "set etp=1"),
    # ep = 1 with etp left at 0 (= tp) ran before, with the experts' gradients 0.04 off
    ({"tp": 2, "num_experts": 4}, "set etp=1"),
    ({"pp": 2, "schedule": "pipedream", "num_microbatches": 2}, "asynchronously"),
    ({"tp": 2, "cp_algorithm": "usp"}, "cp_algorithm"),
    ({"dp": 2, "optimizer": "sgd"}, "AdamW"),
])
def test_bad_hybrid_cases_are_rejected_before_spawning(ov, msg):
    with pytest.raises(ConfigError, match=msg):
        make_case(**ov)


def test_traffic_suite_table_measured_equals_model(pools, tmp_path):
    """The traffic suite's case (UB-Mesh Table 1's structure at small scale, 8 ranks): every
    row of rank 0's measured ledger equals the closed form, and the paper's two printing
    errors are flagged beside the traffic model at the paper's configuration."""
    from parbench.reproduce import ubmesh_measured as table
    from parbench.suites import load_suite
    (case,) = load_suite("traffic").cases
    merged, per_rank = run_on_pool(pools, case)
    assert_exact(case, merged, per_rank)
    (path,) = get_scheme("hybrid").figures(case, per_rank, tmp_path)
    text = path.read_text()
    rows = [ln for ln in text.splitlines() if ln.startswith("| ") and "Parallelism" not in ln]
    assert len(rows) == 5 and all(ln.endswith("| yes |") for ln in rows), text
    assert "TP total: printed 1775 GB" in text and "PP share: printed 0.14%" in text
    r0 = next(r for r in per_rank if r.rank == 0)
    meas = table.measured(r0.ledger)
    assert all(meas[row] for row in table.ROWS), meas  # every axis carries traffic
