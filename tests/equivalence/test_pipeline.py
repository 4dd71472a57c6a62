"""Every pipeline schedule on real gloo ranks: equal to the golden run (PipeDream and 2BW,
run continuously, to the single-device run of their own rule), p2p bytes, send calls and
model states equal to the closed forms of ``parbench.analytic.pipeline`` on every checked
step, and the graphs the executor really held (measured from the saved storages) equal to
the simulator's count."""
from __future__ import annotations

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from parbench.config import CaseConfig, ConfigError
from parbench.overrides import apply_overrides
from parbench.schedules import CONTINUOUS, SCHEDULES, ChunkRule, max_inflight
from parbench.registry import get_scheme
from parbench.verdict import figures_equal
from tests.helpers import run_on_pool

from impls.pipeline.scheme import schedule_for

NAMES = list(SCHEDULES)


def _case(name: str, p: int, m: int, v: int, layers_per_stage: int, mbs: int = 1,
          steps: int = 2, optimizer: str = "adamw") -> CaseConfig:
    """A small case. With AdamW the parameter tolerance is 1e-4 (10% of lr): summing m
    micro-batch gradients instead of one full-batch gradient changes a gradient element of
    ~1e-9 (near eps = 1e-8) in its last bits, and AdamW's update lr*m/(sqrt(v)+eps) turns
    that into ~1e-5 of parameter -- single-process accumulation does the same, no pipeline
    needed. Gradients and losses keep rtol 1e-5 / atol 1e-6; SGD keeps param_atol 1e-5."""
    vpp = v if SCHEDULES[name].chunks is not ChunkRule.ONE else 1
    case = apply_overrides(CaseConfig(), {
        "model": "tiny", "hidden_size": 16, "num_heads": 2, "seq_length": 8,
        "pp": p, "vpp": vpp, "num_microbatches": m, "micro_batch_size": mbs, "steps": steps,
        # the continuous pipelines drain in their last step, which must not be checked
        "timed_steps": 1 if name in CONTINUOUS else 0,
        "optimizer": optimizer, "param_atol": 1e-4 if optimizer == "adamw" else 1e-5,
        "scheme": f"pipeline.{name}"})
    stages = schedule_for(case, name).num_stages
    case.model.num_layers = stages * layers_per_stage
    return case


def _m_for(name: str, p: int, draw) -> int:
    """A micro-batch count the schedule accepts (its generator's rules)."""
    if name == "chimera":
        return p * draw(st.integers(1, 2))
    if name in ("dualpipe", "dualpipev"):
        return 2 * p + 2 * draw(st.integers(0, 1))
    if name == "zb-h2":
        return draw(st.integers(2 * p - 1, 2 * p + 1))
    if name == "interleaved":
        return draw(st.sampled_from([p, 2 * p, max(1, p - 1)]))
    if name in CONTINUOUS:
        return draw(st.integers(p, 2 * p + 1))
    return draw(st.integers(1, 2 * p + 1))


@st.composite
def pipeline_cases(draw):
    name = draw(st.sampled_from(NAMES))
    p = draw(st.sampled_from([2, 4]))
    m = _m_for(name, p, draw)
    v = draw(st.sampled_from([2, 3])) if SCHEDULES[name].chunks is ChunkRule.ANY else 2
    try:
        return _case(name, p, m, v, draw(st.integers(1, 2)), draw(st.integers(1, 2)),
                     optimizer=draw(st.sampled_from(["adamw", "sgd"])))
    except ConfigError:
        assume(False)


def check_case(pools, case):
    cls = get_scheme(case.run.scheme)
    cls.check(case)
    merged, per_rank = run_on_pool(pools, case)
    assert merged.equivalent, merged
    pred = cls.predict(case)
    states = pred.figures.get("model_state_bytes_by_step")
    for r, res in enumerate(per_rank):
        assert all(x["wire_bytes"] == 0 for x in res.ledger if x["op"] == "recv")
        # pp only (BPipe adds its evict and load pairs: test_pipeline_bpipe; tied embeddings
        # their embedding group: test_pipeline_tied)
        assert {x["axis"] for x in res.ledger} <= {"pp", "bpipe_evict", "bpipe_load"} | (
            {"embd"} if case.model.tie_embeddings else set())
        for step in range(case.run.steps):
            assert figures_equal([res.wire_by_axis_per_step[step]], [pred.wire_at(step)[r]]), \
                (r, step, res.wire_by_axis_per_step[step], pred.wire_at(step)[r])
            assert figures_equal([res.calls_by_axis_per_step[step]],
                                 [pred.calls_at(step)[r]]), \
                (r, step, res.calls_by_axis_per_step[step], pred.calls_at(step)[r])
            # every category equal (a category one side does not name counts 0 bytes)
            expected = states[step][r] if states else pred.model_state_bytes[r]
            assert figures_equal([res.model_states_per_step[step]], [expected]), \
                (r, step, res.model_states_per_step[step], expected)
    bubble = per_rank[0].bubble
    detail = bubble.detail
    # the graphs each rank held (its saved storages alive) are the simulator's count: from
    # the forward to the fused backward or to W
    assert detail["held_graphs_measured"] == detail["held_graphs_simulated"]
    schedule = cls.step_schedule(case)
    if SCHEDULES[schedule.name].max_inflight is not None and not schedule.split_backward:
        # a fused backward frees the graph: held = the paper's in-flight bound
        assert detail["held_graphs_measured"] == [
            max_inflight(schedule.name, schedule.p, schedule.m, r) for r in range(schedule.p)]
    assert all(b > 0 for b in bubble.activation_peak_bytes)
    assert bubble.replayed is not None and 0 <= bubble.replayed < 1
    return merged, per_rank


@given(pipeline_cases())
def test_drawn_schedule_equals_golden_with_exact_bytes(pools, case):
    check_case(pools, case)


@pytest.mark.parametrize("name", NAMES)
def test_every_schedule_on_four_ranks(pools, name):
    m = 8
    check_case(pools, _case(name, 4, m, 2, 1, steps=3))


def test_zero_bubble_holds_graphs_until_w(pools):
    """ZB-H1 keeps every graph from F to W: more graphs than 1F1B's in-flight bound on the
    lower ranks (the paper's p M_B counts F to B; W keeps only M_W there)."""
    merged, per_rank = check_case(pools, _case("zb-h1", 4, 8, 1, 1))
    detail = per_rank[0].bubble.detail
    assert detail["inflight_paper_bound"] == [4, 3, 2, 1]
    assert detail["held_graphs_measured"] == detail["held_graphs_simulated"]
    assert all(h >= b for h, b in zip(detail["held_graphs_measured"],
                                      detail["inflight_paper_bound"]))
    assert detail["held_graphs_measured"] != detail["inflight_paper_bound"]


def test_closed_forms_match_the_unit_simulation(pools):
    """Where the paper's costs are the unit costs, the closed form is the simulated bubble."""
    merged, per_rank = check_case(pools, _case("zb-h1", 4, 8, 1, 1))
    bubble = per_rank[0].bubble
    assert bubble.closed_form == pytest.approx(bubble.unit)
    assert bubble.detail["sim_at_closed_form_costs"] == pytest.approx(bubble.closed_form)


def test_bad_schedule_conditions_fail_before_spawning():
    with pytest.raises(ConfigError, match="even p"):
        get_scheme("pipeline.chimera").check(apply_overrides(CaseConfig(), {
            "model": "tiny", "pp": 3, "num_layers": 3, "num_microbatches": 6}))
    with pytest.raises(ConfigError, match="num_layers"):
        get_scheme("pipeline.zbv").check(apply_overrides(CaseConfig(), {
            "model": "tiny-4l", "pp": 4, "num_microbatches": 8}))
    with pytest.raises(ConfigError, match="dp=2"):
        get_scheme("pipeline.1f1b").check(apply_overrides(CaseConfig(), {
            "model": "tiny", "pp": 2, "dp": 2}))


@pytest.mark.parametrize("name, fields", [("1f1b", {"tie_embeddings": True}), ("chimera", {})],
                         ids=["1f1b-tied", "chimera"])
def test_clip_grad_by_global_norm(pools, name, fields):
    """``clip_grad=0.5`` (below the tiny-4l model's gradient norm, so every step clips): the
    norm's squares counted once over pp -- the tied embedding on one stage, one replica of
    Chimera's two -- give the golden run's clipped gradients; bytes and calls equal the
    closed forms, which add one 4-byte all-reduce on pp per rank and step."""
    case = apply_overrides(CaseConfig(), {
        "model": "tiny-4l", "pp": 2, "num_microbatches": 4, "micro_batch_size": 1,
        "steps": 2, "timed_steps": 0, "clip_grad": 0.5, "scheme": f"pipeline.{name}",
        **fields})
    merged, _ = check_case(pools, case)
    assert merged.clipped_steps == case.run.steps and merged.clip_coef_min < 1
    cls = get_scheme(case.run.scheme)
    pred, unclipped = cls.predict(case), cls.predict(apply_overrides(case, {"clip_grad": 0.0}))
    for r, (w, c) in enumerate(zip(pred.wire_bytes, pred.calls)):
        assert w["pp"] - unclipped.wire_bytes[r]["pp"] == 4.0  # 2(n-1)/n x 4 B at n = 2
        assert c["pp"] - unclipped.calls[r]["pp"] == 1


def test_asynchronous_schedules_refuse_clip_grad():
    for name in ("pipedream", "2bw"):
        with pytest.raises(ConfigError, match="clip_grad=0.5"):
            get_scheme(f"pipeline.{name}").check(apply_overrides(CaseConfig(), {
                "model": "tiny-4l", "pp": 2, "num_microbatches": 2, "timed_steps": 1,
                "clip_grad": 0.5}))


def test_pipeline_runs_multi_head_latent_attention(pools):
    """``mla-tiny`` (feature mla, issue 21) under 1F1B on pp 2: each stage is a slice of the
    reference model, so it trains MLA as the golden run does; the p2p bytes are b s h per
    boundary whatever the attention (``check_case``'s closed-form comparison)."""
    case = apply_overrides(CaseConfig(), {
        "scheme": "pipeline.1f1b", "model": "mla-tiny", "pp": 2, "num_microbatches": 2,
        "steps": 2, "timed_steps": 0, "param_atol": 1e-4})
    check_case(pools, case)


@pytest.mark.parametrize("name", ["seq1f1b", "terapipe"])
def test_token_slice_pipelines_refuse_mla_before_spawning(name):
    """A token slice attends to the cached MHA keys of the earlier slices: no MLA there."""
    case = apply_overrides(CaseConfig(), {"scheme": f"pipeline.{name}", "model": "mla-tiny",
                                          "pp": 2, "num_microbatches": 2})
    with pytest.raises(ConfigError, match="kv_lora_rank=16"):
        get_scheme(f"pipeline.{name}").check(case)
