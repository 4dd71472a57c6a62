"""LoongTrain (2D-Attention, Double-Ring-Attention) on real gloo ranks: equivalent to the golden
run, with every rank's wire bytes and calls per group (head ``cp_ulysses``, ``cp_inner``,
``cp_outer``) and model states equal to ``analytic.context_loongtrain`` on every checked step;
a window of 1 or of the whole ring is the single ring, bit for bit the USP run on the same grid.

The fixed cases cover both placements, both kinds of hop, zig-zag and dp x cp; Hypothesis
(``thorough`` profile only) draws more grids, layouts, recomputation and shapes (K/V heads
too: grouped-query attention).
"""
from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parbench.config import ConfigError
from tests.equivalence.test_context import assert_exact, make_case
from tests.helpers import run_on_pool

CASES = [
    # the brief's rows: 2 x 2 head x context grid; a 4-ring of two windows of two
    ("context.loongtrain", {"cp": 4, "cp_ulysses": 2}),
    ("context.loongtrain", {"cp": 4, "cp_ulysses": 1, "cp_window": 2}),
    # context-first placement (head groups strided, the ring on neighbours), striped layout,
    # full recomputation
    ("context.loongtrain-cf", {"cp": 4, "cp_ulysses": 2, "cp_window": 2,
                               "cp_balance": "striped", "recompute": "full", "num_layers": 1}),
    # dp x cp
    ("context.loongtrain", {"cp": 2, "dp": 2, "cp_window": 1, "num_microbatches": 2}),
]


@pytest.mark.parametrize("scheme,ov", CASES, ids=[f"{s}-{i}" for i, (s, _) in enumerate(CASES)])
def test_loongtrain_matches_golden_with_exact_bytes(pools, scheme, ov):
    case = make_case(scheme, **{"cp_balance": "zigzag", **ov})
    merged, per_rank = run_on_pool(pools, case)
    assert merged.equivalent, (merged.max_loss_abs, merged.max_grad_abs, merged.max_param_abs)
    assert not merged.uncovered
    assert_exact(case, per_rank)
    w = case.options.context.cp_window
    c = case.layout.cp // case.options.context.cp_ulysses
    hops = {a for r in per_rank for a, v in r.wire_by_axis_per_step[0].items() if v}
    assert ("cp_inner" in hops) == (w > 1) and ("cp_outer" in hops) == (c // w > 1), hops


def test_loongtrain_runs_grouped_query_attention(pools):
    """LLaMA blocks with 8 query heads over 4 K/V heads on a 2 x 2 head x context grid: after
    the head all-to-all a rank holds 4 query heads and their 2 K/V heads, the double ring
    passes K/V blocks of those 2 heads; packed documents; bytes and calls per group equal
    ``analytic.context_loongtrain``'s at the K/V width, the layer's saved activations the
    formula's (the LLaMA blocks' terms)."""
    case = make_case("context.loongtrain", cp=4, cp_ulysses=2, cp_window=1,
                     cp_balance="zigzag", model="llama-tiny", num_heads=8, num_kv_heads=4,
                     pack_docs=3, micro_batch_size=1, num_microbatches=2)
    merged, per_rank = run_on_pool(pools, case)
    assert merged.equivalent, merged.first_failure
    assert not merged.uncovered
    assert_exact(case, per_rank)


@pytest.mark.parametrize("window", [1, 4])
def test_a_window_of_one_or_of_the_ring_is_usp_bit_for_bit(pools, window):
    ov = {"cp": 4, "cp_balance": "zigzag", "num_layers": 1, "steps": 2}
    usp, _ = run_on_pool(pools, make_case("context.usp", **ov))
    mine, per_rank = run_on_pool(pools, make_case("context.loongtrain", cp_window=window, **ov))
    assert mine.equivalent and usp.equivalent
    # the same kernels, merges and accumulations in the same order as the single ring
    assert mine.losses == usp.losses
    assert (mine.max_grad_abs, mine.max_param_abs) == (usp.max_grad_abs, usp.max_param_abs)
    ring_bytes = sum(usp.wire_by_axis[0].get(a, 0) for a in ("cp_ring",))
    mine_bytes = sum(mine.wire_by_axis[0].get(a, 0) for a in ("cp_inner", "cp_outer"))
    assert ring_bytes == mine_bytes > 0


def test_bad_grid_fails_before_spawning_with_one_line():
    for ov, rule in [({"cp": 4, "cp_window": 3}, "cp_window=3 does not divide the context ring"),
                     ({"cp": 4, "cp_ulysses": 2, "cp_window": 4}, "cp_window=4 does not divide"),
                     ({"cp": 4, "cp_ulysses": 3}, "cp_ulysses=3 does not divide cp=4"),
                     ({"cp": 4, "cp_ulysses": 4, "num_heads": 2, "hidden_size": 16},
                      "cp_ulysses=4 does not divide num_heads=2"),
                     ({"cp": 4, "cp_ulysses": 2, "model": "llama-tiny", "num_kv_heads": 1},
                      "cp_ulysses=2 does not divide num_kv_heads=1 \\(the head group shards "
                      "the K/V heads"),
                     ({"cp": 4, "cp_window": 2, "seq_length": 12, "cp_balance": "zigzag"},
                      "2\\*4 to divide seq_length=12")]:
        with pytest.raises(ConfigError, match=rule) as err:
            make_case("context.loongtrain", **ov)
        assert "\n" not in str(err.value)


@st.composite
def cases(draw):
    cp = draw(st.sampled_from([2, 4]))
    dp = draw(st.sampled_from([1, 2])) if cp == 2 else 1
    heads = draw(st.sampled_from([2, 4]))
    u = draw(st.sampled_from([d for d in (1, 2, 4) if cp % d == 0 and heads % d == 0]))
    c = cp // u
    w = draw(st.sampled_from([d for d in (1, 2, 4) if c % d == 0]))
    kv = draw(st.sampled_from([g for g in (1, 2, 4) if heads % g == 0 and g % u == 0]))
    head_dim = draw(st.sampled_from([4, 8]))
    return make_case(
        draw(st.sampled_from(["context.loongtrain", "context.loongtrain-cf"])),
        cp=cp, dp=dp, cp_ulysses=u, cp_window=w, num_heads=heads, num_kv_heads=kv,
        hidden_size=heads * head_dim, num_layers=draw(st.integers(1, 2)),
        vocab_size=draw(st.sampled_from([61, 96])), seq_length=2 * cp * draw(st.integers(1, 3)),
        cp_balance=draw(st.sampled_from(["none", "zigzag", "striped"])),
        recompute=draw(st.sampled_from(["none", "selective", "full"])),
        num_microbatches=draw(st.integers(1, 2)), micro_batch_size=draw(st.integers(1, 2)))


@settings(max_examples=100 if os.environ.get("HYPOTHESIS_PROFILE") == "thorough" else 2)
@given(case=cases())
def test_loongtrain_drawn_cases(pools, case):
    merged, per_rank = run_on_pool(pools, case)
    assert merged.equivalent, (merged.max_loss_abs, merged.max_grad_abs, merged.max_param_abs)
    assert_exact(case, per_rank)
