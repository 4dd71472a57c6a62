"""DistFlashAttn (``context.distflashattn``) on real gloo ranks: the balanced causal schedule,
its overlapped point-to-point messages and rematerialization-aware checkpointing against the
golden run, with every rank's wire bytes, calls and model states equal to
``analytic.context_distflash`` on every checked step, each worker's block computations equal
to the schedule's closed form, and the attention forward run once per layer and micro-batch
under ``recompute=full`` (twice under the naive ``selective``).

The ``thorough`` profile draws further shapes, odd and even cp, dp x cp, recomputation and
micro-batching, and compares the measured attention-kernel CPU time of the balanced schedule
with the unbalanced causal ring on a longer sequence.
"""
from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parbench.analytic import context_distflash as closed
from parbench.config import ConfigError
from parbench.registry import get_scheme
from tests.equivalence.test_context import assert_exact, make_case
from tests.helpers import run_on_pool

SCHEME = "context.distflashattn"
THOROUGH = os.environ.get("HYPOTHESIS_PROFILE") == "thorough"


def _per_cp(text: str) -> list[float]:
    return [float(x) for x in text.split(" / ")]


def check_row(case, merged, per_rank) -> dict:
    assert merged.equivalent, (merged.max_loss_abs, merged.max_grad_abs, merged.max_param_abs)
    assert not merged.uncovered
    assert_exact(case, per_rank)
    m = per_rank[0].metrics
    p = case.layout
    assert _per_cp(m["attention_blocks_per_cp_rank"]) == closed.blocks_per_worker(p.cp)
    passes = 2 if case.options.recompute == "selective" else 1
    fwd = case.model.num_layers * p.num_microbatches * passes
    assert m["attention_forwards_per_step"] == fwd == m["attention_forwards_per_step_predicted"]
    return m


@pytest.mark.parametrize("ov", [
    {"cp": 4, "recompute": "full", "num_microbatches": 2},
    {"cp": 2, "dp": 2, "recompute": "selective"},
], ids=["cp4-remat", "dp2xcp2-naive-recompute"])
def test_distflashattn_matches_golden_with_exact_bytes_and_blocks(pools, ov):
    case = make_case(SCHEME, **ov)
    merged, per_rank = run_on_pool(pools, case)
    check_row(case, merged, per_rank)


def test_remat_checkpoint_sends_what_no_recompute_sends(pools):
    """Sec. 3.3 by measurement: with the checkpoint at the attention output the step's cp
    bytes on every rank are those of no recomputation; the naive recompute (``selective``,
    the core checkpointed at its inputs) sends the forward's messages again."""
    wire = {}
    for rc in ("none", "full", "selective"):
        case = make_case(SCHEME, cp=4, recompute=rc, num_layers=1, steps=1)
        merged, per_rank = run_on_pool(pools, case)
        assert merged.equivalent
        wire[rc] = [r.wire_by_axis_per_step[0]["cp"] for r in sorted(per_rank,
                                                                      key=lambda r: r.rank)]
    assert wire["full"] == wire["none"]
    assert all(s > n for s, n in zip(wire["selective"], wire["none"]))


def test_bad_input_fails_before_spawning_with_one_line():
    for ov, rule in [({"cp": 2, "dtype": "bf16"}, "fp32 only"),
                     ({"cp": 2, "tp": 2}, "tp=2 is not used"),
                     ({"cp": 2, "num_kv_heads": 2}, "num_kv_heads=2")]:
        with pytest.raises(ConfigError, match=rule) as err:
            make_case(SCHEME, **ov)
        assert "\n" not in str(err.value)
    assert get_scheme(SCHEME).options == ("recompute",)


@st.composite
def cases(draw):
    cp = draw(st.sampled_from([2, 3, 4]))
    dp = draw(st.sampled_from([1, 2])) if cp == 2 else 1
    heads = draw(st.sampled_from([2, 4]))
    return make_case(
        SCHEME, cp=cp, dp=dp, num_heads=heads, hidden_size=heads * draw(st.sampled_from([4, 8])),
        num_layers=draw(st.integers(1, 2)), vocab_size=draw(st.sampled_from([61, 96])),
        seq_length=cp * draw(st.integers(2, 4)),  # n >= 2: at n = 1 transposes copy nothing
        recompute=draw(st.sampled_from(["none", "selective", "full"])),
        num_microbatches=draw(st.integers(1, 2)), micro_batch_size=draw(st.integers(1, 2)))


@settings(max_examples=100 if THOROUGH else 2)
@given(case=cases())
def test_distflashattn_drawn_cases(pools, case):
    merged, per_rank = run_on_pool(pools, case)
    check_row(case, merged, per_rank)
