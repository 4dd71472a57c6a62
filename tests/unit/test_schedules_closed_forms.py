"""The simulator reproduces the papers' closed forms exactly where the papers claim them.

Every expected value is computed from the published formula (parbench.schedules.
closed_forms or written out here), never copied from simulator output.  Which formula a
schedule claims, and at which costs its paper states it, comes from its `ScheduleSpec`.
"""
from __future__ import annotations

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from parbench.schedules import (
    SCHEDULES,
    ChunkRule,
    closed_form,
    make_schedule,
    max_inflight,
    paper_closed_form,
    simulate,
    validate,
)
from parbench.schedules.closed_forms import (
    chimera_bubble_ratio,
    dualpipe_table2,
    gpipe_bubble_ratio,
    interleaved_bubble_ratio,
    one_f_one_b_bubble_ratio,
    ptdp_bubble_fraction,
    ratio_from_fraction,
    ratio_from_size,
    zb_h2_size_from_start,
    zero_bubble_table2,
)

try:  # tests/unit is a rootdir-relative folder today; also work if it becomes a package
    from .test_schedules import PROFILE, supported
except ImportError:
    from test_schedules import PROFILE, supported

cost = st.sampled_from([0.5, 1.0, 1.5, 2.0, 3.0])


def idle_per_rank(sim) -> float:
    """Bubble size: every rank does the same work in these schedules."""
    assert max(sim.busy) == pytest.approx(min(sim.busy))
    return sim.makespan - sim.busy[0]


# -- conversions ----------------------------------------------------------------------
@given(st.integers(1, 64), st.integers(1, 256), st.integers(1, 8))
def test_fraction_and_ratio_conversions_agree(p, m, v):
    # PTD-P's bubble over ideal time, (p-1)/(v m), is parbench's (p-1)/(v m + p - 1)
    assert ratio_from_fraction(ptdp_bubble_fraction(p, m, v)) == pytest.approx(
        interleaved_bubble_ratio(p, m, v))
    assert ratio_from_fraction(ptdp_bubble_fraction(p, m)) == pytest.approx(gpipe_bubble_ratio(p, m))
    # a bubble size of (p-1) units against m units of work per rank
    assert ratio_from_size(p - 1, m) == pytest.approx(gpipe_bubble_ratio(p, m))


# -- GPipe, 1F1B, asynchronous 1F1B order ------------------------------------------------
@PROFILE
@given(st.sampled_from(["gpipe", "1f1b", "pipedream", "2bw"]), st.integers(1, 8), st.integers(1, 24),
       cost, cost, cost)
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(name, p, m, tf, tb, tw):
    sim = simulate(make_schedule(name, p, m), tf, tb, tw)
    assert sim.bubble == pytest.approx(one_f_one_b_bubble_ratio(p, m))
    assert idle_per_rank(sim) == pytest.approx((p - 1) * (tf + tb + tw))
    # splitting BW into B then W sends the gradient before W runs: never a larger bubble
    split = simulate(make_schedule(name, p, m, split_backward=True), tf, tb, tw)
    assert split.makespan <= sim.makespan + 1e-9


@PROFILE
@given(st.integers(1, 8), st.integers(1, 24))
def test_in_flight_limits_1f1b_and_gpipe(p, m):
    one = simulate(make_schedule("1f1b", p, m))
    assert one.peak_inflight == [max_inflight("1f1b", p, m, r) for r in range(p)]
    assert one.peak_inflight[0] == min(p, m)
    assert simulate(make_schedule("gpipe", p, m)).peak_inflight == [m] * p


# -- interleaved and breadth-first --------------------------------------------------------
@PROFILE
@given(st.integers(1, 6), st.integers(1, 4), st.integers(2, 4), cost, cost, cost)
def test_interleaved_matches_ptdp_when_p_divides_m(p, rounds, v, tf, tb, tw):
    m = p * rounds
    sim = simulate(make_schedule("interleaved", p, m, v), tf, tb, tw)
    assert sim.bubble == pytest.approx(interleaved_bubble_ratio(p, m, v))
    assert idle_per_rank(sim) == pytest.approx((p - 1) * (tf + tb + tw))
    # PTD-P §2.2.2: bubble time / ideal time = (p-1)/(v m)
    assert idle_per_rank(sim) / sim.busy[0] == pytest.approx(ptdp_bubble_fraction(p, m, v))


@PROFILE
@given(st.integers(1, 6), st.integers(1, 3), st.integers(2, 4))
def test_interleaved_in_flight_follows_megatron_warmup(p, rounds, v):
    """Megatron-LM's interleaved schedule warms rank r up with (p-r-1)*2 + (v-1)*p
    forwards (capped at m*v); one more forward runs before the first backward."""
    m = p * rounds
    sim = simulate(make_schedule("interleaved", p, m, v))
    assert sim.peak_inflight == [min(m * v, 2 * (p - r - 1) + (v - 1) * p + 1) for r in range(p)]


@PROFILE
@given(st.integers(1, 6), st.integers(0, 12), st.integers(1, 4), cost, cost)
def test_interleaved_relaxed_grouping_and_bfs_for_m_at_least_p(p, extra, v, tf, tb):
    m = p + extra
    if supported("interleaved", p, m, v) and v >= 2:
        sim = simulate(make_schedule("interleaved", p, m, v), tf, tb, 0.0)
        assert sim.bubble == pytest.approx(interleaved_bubble_ratio(p, m, v))
    sim = simulate(make_schedule("bfs", p, m, v), tf, tb, 0.0)
    assert sim.bubble == pytest.approx(interleaved_bubble_ratio(p, m, v))


# -- Zero Bubble, Table 2 --------------------------------------------------------------------
def test_zb_h1_p4_m8_unit_costs_equals_closed_form():
    sim = simulate(validate(make_schedule("zb-h1", 4, 8)), tf=1, tb=1, tw=1)
    size = zero_bubble_table2(4, 1, 1, 1)["zb-h1"].bubble      # (p-1)(T_F+T_B-T_W) = 3
    assert sim.bubble == pytest.approx(ratio_from_size(size, 8 * 3))  # 3 / 27
    assert sim.bubble == pytest.approx(1 / 9)


@PROFILE
@given(st.integers(1, 8), st.integers(0, 12), cost, cost, cost)
def test_zb_table2_rows_1f1b_and_zb_h1(p, extra, tf, tb, tw):
    assume(tw <= min(tf, tb))           # where the ZB-H1 row holds (see closed_forms)
    m = p + extra
    table = zero_bubble_table2(p, tf, tb, tw)
    fused_1f1b = simulate(make_schedule("1f1b", p, m), tf, tb, tw)   # BW costs T_B + T_W
    assert idle_per_rank(fused_1f1b) == pytest.approx(table["1f1b"].bubble)
    zb1 = simulate(make_schedule("zb-h1", p, m), tf, tb, tw)
    assert idle_per_rank(zb1) == pytest.approx(table["zb-h1"].bubble)
    assert zb1.peak_inflight[0] == table["zb-h1"].memory == table["1f1b"].memory == p


@pytest.mark.parametrize("tf,tb,tw", [(1, 1, 1), (2, 2, 1), (1.5, 1.2, 1.0), (3, 2, 1), (1, 1, 0.5)])
def test_zb_h1_unequal_costs_examples(tf, tb, tw):
    p, m = 4, 8
    sim = simulate(make_schedule("zb-h1", p, m), tf, tb, tw)
    assert idle_per_rank(sim) == pytest.approx((p - 1) * (tf + tb - tw))


@PROFILE
@given(st.integers(1, 8), st.integers(0, 10), cost, cost, cost)
def test_zb_table2_row_zb_h2(p, extra, tf, tb, tw):
    assume(tw <= tf and 2 * tw <= tf + tb)
    m = 2 * p - 1 + extra
    row = zero_bubble_table2(p, tf, tb, tw)["zb-h2"]
    sim = simulate(make_schedule("zb-h2", p, m), tf, tb, tw)
    # the paper's parallelogram bubble ...
    assert sim.span_bubble == pytest.approx(row.bubble)
    # ... and the idle time from a common start, which adds the forward ramp
    assert idle_per_rank(sim) == pytest.approx(zb_h2_size_from_start(p, tf, tb, tw))
    assert sim.peak_inflight[0] == row.memory == 2 * p - 1
    assert sim.peak_inflight == [max_inflight("zb-h2", p, m, r) for r in range(p)]


def test_zb_h2_unit_costs_is_a_parallelogram():
    p, m = 4, 8
    sim = simulate(make_schedule("zb-h2", p, m), 1, 1, 1)
    assert sim.span_bubble == 0 == zero_bubble_table2(p, 1, 1, 1)["zb-h2"].bubble
    for rank in range(p):  # rank r works without a gap from time r to r + 3m
        assert sim.idle[rank] == ([(0.0, float(rank))] if rank else []) + (
            [(rank + 3.0 * m, p - 1 + 3.0 * m)] if rank < p - 1 else [])


@PROFILE
@given(st.integers(1, 7), st.integers(0, 8))
def test_zbv_zero_bubble_with_equal_costs(p, extra):
    m = 2 * p - 1 + extra
    sim = simulate(make_schedule("zbv", p, m), 1, 1, 1)
    assert sim.span_bubble == 0
    assert idle_per_rank(sim) == p - 1          # the (p-1) T_F forward ramp
    assert sim.peak_inflight == [2 * p] * p     # 2p half-stage chunks = 1F1B's p M_B


# -- Chimera -------------------------------------------------------------------------------
@PROFILE
@given(st.integers(1, 5), st.integers(1, 4), cost)
def test_chimera_bubble_ratio_with_equal_forward_and_backward(half, units, t):
    D = 2 * half
    N = units * D
    sim = simulate(make_schedule("chimera", D, N), tf=t, tb=t, tw=0.0)
    assert sim.bubble == pytest.approx(chimera_bubble_ratio(D, N))
    assert idle_per_rank(sim) == pytest.approx((D - 2) * t)
    assert max(sim.peak_inflight) <= D


@pytest.mark.parametrize("D", [2, 4, 6, 8])
def test_chimera_activation_range_one_unit(D):
    sim = simulate(make_schedule("chimera", D, D), tf=1, tb=1, tw=0)
    # Li & Hoefler Table 2: activations between (D/2+1) M_a and D M_a per worker
    assert min(sim.peak_inflight) == D // 2 + 1 if D > 2 else 2
    assert max(sim.peak_inflight) == D


# -- DualPipe / DualPipeV, DeepSeek-V3 Table 2 ------------------------------------------------
@PROFILE
@given(st.sampled_from(["dualpipe", "dualpipev"]), st.integers(1, 5), st.integers(0, 4), cost, cost, cost)
def test_dualpipe_table2_row_with_overlapped_pairs(name, k, extra, tf, tb, tw):
    assume(tf <= tb and tw <= tb)
    p = 2 * k if name == "dualpipe" else k
    m = 2 * p + 2 * extra
    pp = p if name == "dualpipe" else 2 * p      # DualPipeV: read PP as its 2p stages
    row = dualpipe_table2(pp, F=tf, B=tb + tw, W=tw)["dualpipe"]
    schedule = make_schedule(name, p, m)
    sim = simulate(schedule, tf, tb, tw, overlap=True)
    assert idle_per_rank(sim) == pytest.approx(row.bubble)
    assert sim.peak_inflight == [row.memory] * p          # activation PP + 1
    # parameters 2x: each rank holds two of the p stages of a model replica (DualPipe)
    if name == "dualpipe":
        assert all(len(schedule.stages_of(r)) == 2 for r in range(p)) and schedule.num_stages == p


def test_dualpipe_and_zero_bubble_tables_agree_on_shared_rows():
    for p, tf, tb, tw in [(4, 1, 1, 1), (8, 2, 1.5, 0.5)]:
        ds = dualpipe_table2(p, F=tf, B=tb + tw, W=tw)
        zb = zero_bubble_table2(p, tf, tb, tw)
        assert ds["1f1b"].bubble == pytest.approx(zb["1f1b"].bubble)
        assert ds["zb1p"].bubble == pytest.approx(zb["zb-h1"].bubble)


def test_dualpipe_sequential_pairs_are_not_the_table_row():
    """Documented gap: with F&B pairs as plain adjacent actions the F may start
    before the pair's backward input arrives, so the simulated bubble is smaller
    than the table's; it is never larger (fewer constraints)."""
    p, m = 8, 20
    row = dualpipe_table2(p, F=1, B=2, W=1)["dualpipe"]   # (4-1)(3+2-3) = 6
    sim = simulate(make_schedule("dualpipe", p, m), 1, 1, 1)
    assert idle_per_rank(sim) < row.bubble


# -- closed_form(): every "exact" claim is reproduced -------------------------------------------
@PROFILE
@given(st.sampled_from(sorted(SCHEDULES)), st.integers(1, 8), st.integers(1, 20),
       st.sampled_from([None, 2, 3]), cost, cost, cost, st.booleans())
def test_closed_form_exact_claims_hold(name, p, m, v, tf, tb, tw, overlap):
    if SCHEDULES[name].chunks is not ChunkRule.ANY:
        v = None                    # only the looped schedules take a v of their own
    if name == "chimera":
        tb, tw = tf, 0.0            # Chimera's formula counts equal F and B slots
    assume(supported(name, p, m, v))
    schedule = make_schedule(name, p, m, v)
    claim = closed_form(schedule, tf, tb, tw, overlap=overlap)
    assume(claim is not None and claim.exact)
    sim = simulate(schedule, tf, tb, tw, overlap=overlap)
    assert idle_per_rank(sim) == pytest.approx(claim.bubble_size)
    assert sim.bubble == pytest.approx(claim.bubble_ratio)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_closed_form_is_exact_at_its_papers_costs(name):
    """The pipeline table's closed form: at the paper's costs it is the simulated bubble."""
    schedule = make_schedule(name, 4, 8)
    claim, costs = paper_closed_form(schedule)
    assert claim is not None and claim.exact, name
    assert costs == SCHEDULES[name].paper_costs
    sim = simulate(schedule, **costs.as_kwargs())
    assert sim.bubble == pytest.approx(claim.bubble_ratio)
    assert idle_per_rank(sim) == pytest.approx(claim.bubble_size)


def test_paper_costs_where_the_paper_differs_from_unit_costs():
    assert SCHEDULES["chimera"].paper_costs.as_kwargs() == \
        {"tf": 1.0, "tb": 1.0, "tw": 0.0, "overlap": False}   # T_F = fused backward
    for name in ("dualpipe", "dualpipev"):
        assert SCHEDULES[name].paper_costs.overlap            # F&B pairs as units
    # at unit costs Chimera's paper makes no claim; interleaved with m < p is not exact
    chimera = make_schedule("chimera", 4, 8)
    assert not closed_form(chimera).exact and closed_form(chimera).bubble_ratio is None
    assert closed_form(make_schedule("interleaved", 4, 2, 2)).exact is False
