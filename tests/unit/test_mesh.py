"""The rank grid equals Megatron-Core's RankGenerator for the same degrees."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from parbench.layout import Layout

megatron_ps = pytest.importorskip(
    "megatron.core.parallel_state",
    reason="megatron-core is a test dependency (pip install -e .[test]); it is the reference")

DENSE = {"tp": "tp", "cp": "cp", "dp": "dp", "pp": "pp", "dp_cp": "dp-cp", "tp_cp": "tp-cp",
         "mp": "tp-pp", "tp_dp_cp": "tp-cp-dp"}
EXPERT = {"ep": "ep", "etp": "tp", "edp": "dp"}


@st.composite
def degrees(draw):
    tp, cp, dp, pp = (draw(st.sampled_from([1, 2, 3, 4])) for _ in range(4))
    ep = draw(st.sampled_from([d for d in range(1, cp * dp + 1) if (cp * dp) % d == 0]))
    return dict(tp=tp, cp=cp, dp=dp, pp=pp, ep=ep)


@given(degrees())
def test_layout_matches_megatron_core(deg):
    layout = Layout(**deg)
    dense = megatron_ps.RankGenerator(tp=deg["tp"], ep=1, dp=deg["dp"], pp=deg["pp"],
                                      cp=deg["cp"], order="tp-cp-ep-dp-pp")
    for ours, theirs in DENSE.items():
        assert layout.groups(ours) == dense.get_ranks(theirs), ours
    expert = megatron_ps.RankGenerator(tp=deg["tp"], ep=deg["ep"],
                                       dp=deg["cp"] * deg["dp"] // deg["ep"], pp=deg["pp"],
                                       cp=1, order="tp-ep-dp-pp")
    for ours, theirs in EXPERT.items():
        assert layout.groups(ours) == expert.get_ranks(theirs), ours


def test_every_rank_in_exactly_one_group_of_each_kind():
    layout = Layout(tp=2, cp=1, dp=2, pp=2, ep=2)
    for name in ("tp", "dp", "pp", "ep", "mp"):
        members = sorted(r for g in layout.groups(name) for r in g)
        assert members == list(range(8)), name


def test_coords_round_trip():
    layout = Layout(tp=2, cp=3, dp=2, pp=2)
    for r in range(layout.world_size):
        assert layout.rank_of(**layout.coords(r)) == r


def test_ep_must_divide_cp_dp():
    with pytest.raises(ValueError, match="ep=3 does not divide cp\\*dp=4"):
        Layout(dp=4, ep=3)
