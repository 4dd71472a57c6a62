"""Hanayo with two waves, V-Half and V-Min on real gloo ranks: equal to the golden run, p2p
bytes and calls equal to the wave / V closed forms, and the graphs each rank held (measured
from its saved storages) equal to the simulator's count and within the building block's
bound. (The four-rank case of every schedule is in ``test_pipeline``.)"""
from __future__ import annotations

import pytest

from parbench.analytic import pipeline as closed
from parbench.schedules import max_inflight
from tests.equivalence.test_pipeline import _case, check_case


def test_hanayo_two_waves_on_two_ranks(pools):
    case = _case("hanayo", 2, 4, 4, 1)
    merged, per_rank = check_case(pools, case)
    # two waves over two ranks: every boundary but the three turns crosses ranks
    assert [closed.p2p_sends("wave", 2, 4, r, 4) for r in range(2)] == [(8, 8), (8, 8)]
    bubble = per_rank[0].bubble
    assert bubble.detail["sim_at_closed_form_costs"] == pytest.approx(bubble.closed_form)


@pytest.mark.parametrize("name", ["vhalf", "vmin"])
def test_v_blocks_hold_what_the_simulator_counts(pools, name):
    case = _case(name, 2, 5, 2, 1)
    merged, per_rank = check_case(pools, case)
    detail = per_rank[0].bubble.detail
    bound = [max_inflight(name, 2, 5, r) for r in range(2)]
    assert detail["inflight_paper_bound"] == bound
    assert all(s <= b for s, b in zip(detail["inflight_simulated"], bound))
