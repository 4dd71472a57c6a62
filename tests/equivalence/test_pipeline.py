"""Every pipeline schedule on real gloo ranks: equal to the golden run (PipeDream and 2BW to
the single-device run of their own rule), p2p bytes and model states equal to the analytic
figures exactly, and the executor's in-flight peak equal to the simulator's."""
from __future__ import annotations

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from parbench.config import CaseConfig, ConfigError
from parbench.overrides import apply_overrides
from parbench.schedules import SCHEDULES, ChunkRule
from parbench.scheme import get_scheme
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
    for r, res in enumerate(per_rank):
        sent = sum(x["wire_bytes"] for x in res.ledger if x["op"] == "send")
        assert sent == pred.wire_bytes[r]["pp"], (r, sent, pred)
        assert all(x["wire_bytes"] == 0 for x in res.ledger if x["op"] == "recv")
        assert {x["axis"] for x in res.ledger} <= {"pp"}
        # every category equal (a category one side does not name counts 0 bytes)
        assert figures_equal([res.model_state_bytes], [pred.model_state_bytes[r]]), \
            (r, res.model_state_bytes, pred.model_state_bytes[r])
    metrics = per_rank[0].metrics
    detail = metrics["bubble_detail"]
    assert detail["peak_inflight_measured"] == detail["peak_inflight_simulated"]
    assert metrics["bubble_replayed"] is not None and 0 <= metrics["bubble_replayed"] < 1
    return merged, per_rank


@given(pipeline_cases())
def test_drawn_schedule_equals_golden_with_exact_bytes(pools, case):
    check_case(pools, case)


@pytest.mark.parametrize("name", NAMES)
def test_every_schedule_on_four_ranks(pools, name):
    m = 8
    check_case(pools, _case(name, 4, m, 2, 1, steps=3))


def test_closed_forms_match_the_unit_simulation(pools):
    """Where the paper's costs are the unit costs, the closed form is the simulated bubble."""
    merged, per_rank = check_case(pools, _case("zb-h1", 4, 8, 1, 1))
    metrics = per_rank[0].metrics
    assert metrics["bubble_closed_form"] == pytest.approx(metrics["bubble_unit"])
    assert metrics["bubble_detail"]["sim_at_closed_form_costs"] == \
        pytest.approx(metrics["bubble_closed_form"])


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
