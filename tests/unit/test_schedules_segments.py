"""Seq1F1B and TeraPipe as schedules: the generators, the slice dependencies in the validator
and the simulator, the closed forms (bubble, in-flight units, p2p) and TeraPipe's DP."""
from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parbench.config import ConfigError
from parbench.schedules import (ScheduleError, closed_form, make_schedule, simulate,
                                validate)
from parbench.schedules.actions import BACKWARD_FULL, FORWARD, Action
from parbench.schedules.basic import gpipe, one_f_one_b
from parbench.schedules.segments import (backward_order, segment_p2p, seq1f1b_inflight,
                                         seq1f1b_memory_ratio)
from parbench.schedules.slicing import (SliceCost, dp_slices, latency, slices_for,
                                        uniform_slices)

SHAPES = [(p, m, k) for p in (1, 2, 3, 4) for m in (1, 2, 3, 5) for k in (1, 2, 3, 4)]


@pytest.mark.parametrize("name,plain", [("seq1f1b", one_f_one_b), ("terapipe", gpipe)])
def test_one_slice_is_the_plain_schedule(name, plain):
    for p, m in itertools.product((1, 2, 4), (1, 3, 8)):
        ours, theirs = make_schedule(name, p, m), plain(p, m)
        assert ours.actions == theirs.actions and ours.segments == 1 and ours.m == m


@pytest.mark.parametrize("name", ["seq1f1b", "terapipe"])
def test_closed_form_and_inflight_are_the_simulation(name):
    for (p, m, k), costs in itertools.product(SHAPES, [(1, 1, 1), (1.0, 2.0, 0.0),
                                                       (1.3, 0.7, 0.4)]):
        s = validate(make_schedule(name, p, m, segments=k))
        assert (s.m, s.segments) == (m * k, k)
        sim = simulate(s, *costs)
        claim = closed_form(s, *costs)
        assert claim.exact and sim.bubble == pytest.approx(claim.bubble_ratio)
        assert sim.bubble == pytest.approx((p - 1) / (m * k + p - 1))
        if name == "seq1f1b":
            assert sim.peak_inflight == [seq1f1b_inflight(p, m, k, r) for r in range(p)]
        else:
            assert sim.peak_inflight == [m * k] * p
        assert sim.peak_held == sim.peak_inflight


def test_seq1f1b_holds_fewer_microbatches_than_1f1b():
    """The paper's memory claim at p = 4: stage 0 holds (p+k-1)/k micro-batches, not p."""
    assert [seq1f1b_memory_ratio(4, 8, 4, r) for r in range(4)] == \
        [7 / 16, 6 / 12, 5 / 8, 4 / 4]
    one = simulate(make_schedule("1f1b", 4, 8)).peak_inflight
    seq = simulate(make_schedule("seq1f1b", 4, 8, segments=4)).peak_inflight
    assert [s / 4 / o for s, o in zip(seq, one)] == [7 / 16, 1 / 2, 5 / 8, 1.0]


def test_backwards_run_last_slice_first():
    assert backward_order(2, 3) == [2, 1, 0, 5, 4, 3]
    s = make_schedule("terapipe", 2, 2, segments=3)
    assert [a.mb for a in s.actions[0] if a.kind == BACKWARD_FULL] == [2, 1, 0, 5, 4, 3]
    assert s.label(Action(FORWARD, 4, 0)) == "F1.1"


def _swap(schedule, rank, first, second):
    rows = [list(r) for r in schedule.actions]
    i, j = rows[rank].index(first), rows[rank].index(second)
    rows[rank][i], rows[rank][j] = rows[rank][j], rows[rank][i]
    return replace(schedule, actions=rows)


@pytest.mark.parametrize("name", ["seq1f1b", "terapipe"])
def test_slice_order_is_a_dependency_of_validator_and_simulator(name):
    s = make_schedule(name, 2, 2, segments=2)
    bad_f = _swap(s, 0, Action(FORWARD, 0, 0), Action(FORWARD, 1, 0))
    bad_b = _swap(s, 1, Action(BACKWARD_FULL, 0, 1), Action(BACKWARD_FULL, 1, 1))
    for bad, needs in ((bad_f, "F0s0"), (bad_b, "BW1s1")):
        with pytest.raises(ScheduleError, match=needs):
            validate(bad)
        with pytest.raises(ScheduleError, match="deadlock"):
            simulate(bad)
    # the same swaps are fine without slices (1F1B / GPipe over independent micro-batches)
    plain = replace(s, segments=1, m=4)
    validate(_swap(plain, 0, Action(FORWARD, 0, 0), Action(FORWARD, 1, 0)))
    with pytest.raises(ScheduleError, match="segments=3"):
        validate(replace(s, segments=3))


@pytest.mark.parametrize("name", ["seq1f1b", "terapipe"])
def test_fast_simulator_and_validator_equal_the_action_by_action_reference(name):
    """The numbered plan (``segment_deps``) and ``Schedule.dependencies`` say the same, on
    good schedules and on ones with the slices out of order."""
    from tests.unit.test_simulator_fast import (assert_same_simulation,
                                                assert_same_validation, cost_settings)
    for p, m, k in [(2, 2, 2), (3, 2, 3), (4, 3, 2)]:
        s = make_schedule(name, p, m, segments=k)
        for kw in cost_settings(s):
            assert_same_simulation(s, **kw)
        assert_same_validation(s)
        bad = _swap(s, p - 1, Action(BACKWARD_FULL, 0, p - 1), Action(BACKWARD_FULL, 1, p - 1))
        assert_same_validation(bad)
        assert_same_simulation(bad)



@pytest.mark.parametrize("name", ["seq1f1b", "terapipe"])
def test_keyed_plan_has_the_slice_dependencies_too(name, monkeypatch):
    """The plan numbered by keys (taken for schedules the numpy path cannot number)."""
    from parbench.schedules import plan_form
    from tests.unit.test_simulator_fast import assert_same_simulation, assert_same_validation
    monkeypatch.setattr(plan_form._Plan, "_encode", lambda self, before: False)
    s = make_schedule(name, 3, 2, segments=3)
    assert not plan_form._Plan(s).regular
    assert_same_simulation(s, tf=1.0, tb=2.0, tw=0.5)
    bad = _swap(s, 1, Action(FORWARD, 0, 1), Action(FORWARD, 1, 1))
    assert_same_validation(bad)
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(bad)


def test_schedule_command_draws_slices(capsys):
    from parbench.cli.schedule import cmd_schedule
    assert cmd_schedule(["seq1f1b", "p=2", "m=2", "segments=2"]) == 0
    out = capsys.readouterr().out
    assert "F1.1" in out and "BW1.0" in out and "(p-1)/(m k + p - 1)" in out


@pytest.mark.parametrize("name", ["seq1f1b", "terapipe"])
def test_p2p_closed_form_counts_the_generated_transfers(name):
    b, s_len, h = 2, 12, 8
    for p, m, k in SHAPES:
        schedule = make_schedule(name, p, m, segments=k)
        sent = Counter(t.src_rank for t in schedule.comm())
        lengths = uniform_slices(s_len, k)
        elements = Counter()
        for t in schedule.comm():
            elements[t.src_rank] += b * lengths[t.mb % k] * h
        for r in range(p):
            nbytes, calls = segment_p2p(p, m, k, r, b=b, s=s_len, h=h)
            assert (nbytes, calls) == (4 * elements[r], sent[r])


def test_generators_refuse_bad_segments():
    with pytest.raises(ScheduleError, match="segments=0"):
        make_schedule("seq1f1b", 2, 2, segments=0)
    with pytest.raises(ScheduleError, match="1f1b takes no option segments"):
        make_schedule("1f1b", 2, 2, segments=2)


# ---- TeraPipe's dynamic programme ------------------------------------------------------------
def _compositions(total: int, count: int | None):
    for n in range(1, total + 1) if count is None else [count]:
        for cuts in itertools.combinations(range(1, total), n - 1):
            bounds = (0, *cuts, total)
            yield [b - a for a, b in zip(bounds, bounds[1:])]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 8), st.integers(1, 5), st.integers(1, 3),
       st.floats(0, 5), st.floats(0, 3), st.floats(0, 2), st.data())
def test_dp_equals_brute_force(total, stages, m, alpha, beta, gamma, data):
    count = data.draw(st.one_of(st.none(), st.integers(1, total)))
    cost = SliceCost(alpha, beta, gamma)
    got = dp_slices(total, cost, stages, m, count=count)
    best = min(latency(c, cost, stages, m) for c in _compositions(total, count))
    assert sum(got) == total and (count is None or len(got) == count)
    assert latency(got, cost, stages, m) == pytest.approx(best, rel=1e-9, abs=1e-12)


def test_dp_shortens_later_slices_and_beats_uniform():
    """Attention makes a later slice dearer (more context), so the DP gives it fewer tokens,
    and its Sec. 3.3 latency is below the uniform slicing's."""
    cost = SliceCost.for_model(16)
    dp = dp_slices(64, cost, 4, 4, count=4)
    assert dp == sorted(dp, reverse=True) and dp[0] > dp[-1] and sum(dp) == 64
    assert latency(dp, cost, 4, 4) < latency(uniform_slices(64, 4), cost, 4, 4)
    # the stated coefficients: 12 h^2 per token, 2 h per causal pair, 16 tokens of overhead
    assert (cost.alpha, cost.beta, cost.gamma) == (16 * 12 * 256, 12 * 256, 32)
    assert cost(3, 5) == cost.alpha + 3 * cost.beta + 32 * 3 * (5 + 2)


def test_granularity_and_slicing_options():
    assert uniform_slices(10, 3) == [4, 3, 3]
    coarse = dp_slices(64, SliceCost.for_model(16), 4, 4, count=4, granularity=8)
    assert all(n % 8 == 0 for n in coarse) and sum(coarse) == 64
    assert slices_for(16, 2, "uniform", hidden=32, stages=2, m=4) == [8, 8]
    assert slices_for(32, 2, "dp", hidden=32, stages=2, m=4) == [17, 15]
    with pytest.raises(ValueError, match="slicing='x'"):
        slices_for(16, 2, "x", hidden=32, stages=2, m=4)


def test_case_errors_before_spawning():
    from parbench.config import CaseConfig
    from parbench.overrides import apply_overrides
    from parbench.registry import get_scheme

    def case(**kw):
        return apply_overrides(CaseConfig(), {"model": "tiny-4l", "pp": "2",
                                              "scheme": "pipeline.seq1f1b", **kw})
    with pytest.raises(ConfigError, match="seq_segments=17 must be in"):
        get_scheme("pipeline.seq1f1b").check(case(seq_segments="17"))
    with pytest.raises(ConfigError, match="vpp=2"):
        get_scheme("pipeline.terapipe").check(case(seq_segments="2", vpp="2"))
