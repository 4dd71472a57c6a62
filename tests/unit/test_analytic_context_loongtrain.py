"""LoongTrain's closed form (``parbench.analytic.context_loongtrain``) by hand and against USP's,
and the double ring's schedule and placements (``impls.context``) by enumeration."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from impls.context.double_ring import DoubleRingPeers
from impls.context.loongtrain import grid_groups
from parbench.analytic import Shape, summarize
from parbench.analytic.context import attention_traffic
from parbench.analytic.context_loongtrain import (check_grid, loongtrain_prediction,
                                                  loongtrain_traffic, versus_usp)


def test_double_ring_traffic_by_hand():
    # b=1, s=16, h=8, a 4-ring (u=1) of two windows of two, fp32: a K/V block is 2 x 4 tokens
    # x 8 x 4 B = 256 B. Inner ring: 1 hop per window, 2 windows -> 2 K/V sends forward, 2
    # backward and 2 dK/dV sends; outer ring: 1 hop -> 1 + 1 + 1.
    tr = summarize(loongtrain_traffic(1, 16, 8, 4, 1, 2, bytes_per_element=4))
    assert tr["cp_inner"] == {"count": 6, "message_bytes": 6 * 256, "wire_bytes": 6 * 256}
    assert tr["cp_outer"] == {"count": 3, "message_bytes": 3 * 256, "wire_bytes": 3 * 256}
    assert "cp_ulysses" not in tr
    # a 2 x 2 head x context grid, one window: Ulysses all-to-alls of the rank's 4 tokens x 8
    # (128 B, half leaves the rank) 8 times; the 2-ring's block is 2 x 8 tokens x 4 heads' width
    tr = summarize(loongtrain_traffic(1, 16, 8, 4, 2, 2, bytes_per_element=4))
    assert tr["cp_ulysses"] == {"count": 8, "message_bytes": 8 * 128, "wire_bytes": 8 * 64}
    assert tr["cp_inner"]["count"] == 3 and tr["cp_inner"]["message_bytes"] == 3 * 256
    assert "cp_outer" not in tr


def test_grouped_query_attention_moves_kv_at_the_kv_width():
    # 8 wide queries over K/V 4 wide (2 K/V heads of 2 for 4 query heads), b=1, s=16, a 2 x 2
    # grid, fp32: the head group's all-to-alls of the rank's 4 tokens move Q and the output at
    # 4 x 8 x 4 B = 128 B, K and V at 4 x 4 x 4 B = 64 B (each twice per layer: forward and
    # backward); the 2-ring's block is 2 x 8 tokens x (4/2) x 4 B = 128 B
    tr = loongtrain_traffic(1, 16, 8, 4, 2, 2, bytes_per_element=4, h_kv=4)
    uly = sorted((t.message_bytes, t.count) for t in tr if t.axis == "cp_ulysses")
    assert uly == [(64, 4), (128, 4)]
    ring = summarize(tr)["cp_inner"]
    assert ring == {"count": 3, "message_bytes": 3 * 128, "wire_bytes": 3 * 128}
    v = versus_usp(1, 16, 8, 4, 2, 2, bytes_per_element=4, h_kv=4)
    assert v["same_total_as_usp"] and v["inner_bytes"] == 3 * 128


def test_recomputation_repeats_the_forward_hops_only():
    plain = summarize(loongtrain_traffic(1, 16, 8, 4, 1, 2, bytes_per_element=4))
    again = summarize(loongtrain_traffic(1, 16, 8, 4, 1, 2, bytes_per_element=4,
                                         recompute=True))
    assert again["cp_inner"]["count"] == plain["cp_inner"]["count"] + 2
    assert again["cp_outer"]["count"] == plain["cp_outer"]["count"] + 1


@given(u=st.sampled_from([1, 2, 4]), c=st.sampled_from([1, 2, 3, 4, 6, 8]),
       data=st.data(), layers=st.integers(1, 3), m=st.integers(1, 2), rc=st.booleans())
def test_same_bytes_as_usp_on_the_same_grid(u, c, data, layers, m, rc):
    w = data.draw(st.sampled_from([d for d in range(1, c + 1) if c % d == 0]))
    cp, b, h, s = u * c, 2, 8 * u, 4 * u * c
    v = versus_usp(b, s, h, cp, u, w, layers, m, 4, rc)
    assert v["same_total_as_usp"] and v["total_bytes"] == v["usp_total_bytes"]
    assert v["head_bytes"] == v["usp_ulysses_bytes"]
    assert v["inner_bytes"] + v["outer_bytes"] == v["usp_ring_bytes"]
    # c - 1 hops either way; (c/w - 1) of them between windows
    hops = summarize(loongtrain_traffic(b, s, h, cp, u, w, layers, m, 4, rc))
    n_in = hops.get("cp_inner", {}).get("count", 0)
    n_out = hops.get("cp_outer", {}).get("count", 0)
    per = layers * m * (3 + int(rc))
    assert (n_in, n_out) == ((c // w) * (w - 1) * per, (c // w - 1) * per)
    if c > 1:
        assert v["outer_hop_share"] == pytest.approx((c // w - 1) / (c - 1))


@pytest.mark.parametrize("c", [2, 4, 8])
def test_window_of_one_or_of_the_ring_is_the_single_ring(c):
    ring = summarize(attention_traffic("ring-attention", 1, 64, 16, c, bytes_per_element=4))["cp"]
    all_outer = summarize(loongtrain_traffic(1, 64, 16, c, 1, 1))
    all_inner = summarize(loongtrain_traffic(1, 64, 16, c, 1, c))
    assert all_outer["cp_outer"] == ring and "cp_inner" not in all_outer
    assert all_inner["cp_inner"] == ring and "cp_outer" not in all_inner


def test_grid_rules_name_field_value_and_rule():
    assert check_grid(8, 2, 2) == (2, 4, 2)
    with pytest.raises(ValueError, match="cp_window=3 does not divide the context ring size "
                                         "cp/cp_ulysses=4"):
        check_grid(8, 2, 3)
    with pytest.raises(ValueError, match="cp_ulysses=3 does not divide cp=8"):
        check_grid(8, 3, 1)


def test_prediction_adds_the_gradient_allreduce_and_a_replica():
    shape = Shape(vocab_size=61, hidden_size=8, num_layers=2, num_heads=2, seq_length=16)
    pred = loongtrain_prediction(shape, cp=4, dp=2, cp_window=2, micro_batch_size=1)
    assert set(pred.wire_bytes) == {"cp_inner", "cp_outer", "dp_cp"}
    assert pred.calls["dp_cp"] == 1 and pred.calls["cp_inner"] == 12


# ---- the schedule and the placements ----------------------------------------------------------


def _peers(c, w, rank):
    inner = SimpleNamespace(size=w, rank=rank % w)
    outer = SimpleNamespace(size=c // w, rank=rank // w)
    return DoubleRingPeers(inner, outer, clock=None)


@pytest.mark.parametrize("c,w", [(4, 2), (6, 2), (6, 3), (8, 4), (8, 1), (8, 8)])
def test_every_block_is_seen_once_and_enters_from_the_previous_window(c, w):
    for rank in range(c):
        p = _peers(c, w, rank)
        seen = [p.source(t, s) for t in range(c // w) for s in range(w)]
        assert sorted(seen) == list(range(c)) and seen[0] == rank == p.rank
        for t in range(1, c // w):
            # the block entering at step t is the one the previous window's rank entered with
            prev = _peers(c, w, (rank - w) % c)
            assert p.source(t, 0) == prev.source(t - 1, 0)
            # the inner ring hands on blocks: at step s, the previous inner rank's at s - 1
            left = _peers(c, w, (rank // w) * w + (rank - 1) % w)
            assert all(p.source(t, s) == left.source(t, s - 1) for s in range(1, w))


def test_head_first_and_context_first_placements():
    # one cp group of 8 ranks (10..17), u = 2 heads x c = 4 context, windows of 2
    g = list(range(10, 18))
    heads, inner, outer = grid_groups([g], 2, 2, head_first=True)
    assert heads == [[10, 11], [12, 13], [14, 15], [16, 17]]  # consecutive: all-to-all close
    assert inner == [[10, 12], [14, 16], [11, 13], [15, 17]]
    assert outer == [[10, 14], [12, 16], [11, 15], [13, 17]]
    heads, inner, outer = grid_groups([g], 2, 2, head_first=False)
    assert heads == [[10, 14], [11, 15], [12, 16], [13, 17]]
    assert inner == [[10, 11], [12, 13], [14, 15], [16, 17]]  # consecutive: inner ring close
    assert outer == [[10, 12], [11, 13], [14, 16], [15, 17]]
    # every partition covers the group once
    for part in grid_groups([g], 2, 2, True) + grid_groups([g], 2, 2, False):
        assert sorted(r for grp in part for r in grp) == g
