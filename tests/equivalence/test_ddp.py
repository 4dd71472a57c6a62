"""Native DDP against the golden run, its bytes against the analytic model, its overlap."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from parbench.config import CaseConfig
from parbench.overrides import apply_overrides
from tests.helpers import run_on_pool
from impls.data.ddp import NativeDDP


@st.composite
def ddp_cases(draw):
    heads = draw(st.sampled_from([1, 2, 4]))
    hidden = heads * draw(st.sampled_from([4, 8]))
    return apply_overrides(CaseConfig(), {
        "model": "tiny", "hidden_size": hidden, "num_heads": heads,
        "num_layers": draw(st.integers(1, 3)), "seq_length": draw(st.sampled_from([4, 8])),
        "dp": draw(st.integers(1, 4)), "micro_batch_size": draw(st.integers(1, 2)),
        "num_microbatches": draw(st.integers(1, 3)),
        "bucket_mb": draw(st.sampled_from([0.001, 0.01, 1.0])),
        "steps": 3, "scheme": "data.ddp"})


@given(ddp_cases())
def test_ddp_equals_golden_and_bytes_are_exact(pools, case):
    merged, per_rank = run_on_pool(pools, case)
    # the loss is held by the verdict's rule inside merged.equivalent: |ours - golden| <=
    # atol + rtol |golden| every step (RunConfig: 1e-6 + 1e-5 x ~ln(128) ~ 5e-5 on the tiny
    # model); a hand-picked absolute 1e-5 here was 5x tighter than that rule on a loss
    # averaged over ranks in another order
    assert merged.equivalent, merged
    pred = NativeDDP.predict(case)
    for r, res in enumerate(per_rank):
        assert res.model_state_bytes == pred.model_state_bytes[r], r
        assert merged.wire_by_axis[r].get("dp", 0.0) == pred.wire_bytes[r]["dp"], r


def test_first_bucket_all_reduce_starts_before_backward_ends(pools):
    case = apply_overrides(CaseConfig(), {"model": "tiny-4l", "dp": 2, "bucket_mb": 0.01,
                                          "num_microbatches": 1, "steps": 3,
                                          "scheme": "data.ddp"})
    merged, per_rank = run_on_pool(pools, case)
    assert merged.equivalent
    for res in per_rank:
        events = res.timeline
        backward = [e for e in events if e["cat"] == "compute" and e["kind"] == "B"]
        comms = sorted((e for e in events if e["cat"] == "comm" and e["kind"] == "all_reduce"),
                       key=lambda e: e["start"])
        assert len(comms) > 1, "several buckets expected"
        assert comms[0]["start"] < backward[-1]["end"], "first all-reduce after backward"


def test_torch_ddp_lands_in_the_same_ledger_with_the_same_bytes(pools):
    base = {"model": "tiny", "dp": 2, "num_microbatches": 2, "steps": 3}
    ours, _ = run_on_pool(pools, apply_overrides(CaseConfig(), {**base, "scheme": "data.ddp"}))
    theirs, per_rank = run_on_pool(pools, apply_overrides(
        CaseConfig(), {**base, "scheme": "baseline.torch.ddp"}))
    assert ours.equivalent and theirs.equivalent
    assert theirs.wire_by_axis == ours.wire_by_axis
    assert all(r["op"] == "all_reduce" for r in per_rank[0].ledger)
