"""torch.distributed.pipelining and DeepSpeed's pipeline engine against our executor on the
same cases: both equal the golden run and put the same point-to-point bytes on the wire."""
from __future__ import annotations

import pytest

from parbench.config import CaseConfig, apply_overrides
from parbench.scheme import get_scheme
from tests.conftest import run_on_pool

from impls.baselines.torch_pipelining import SCHEDULES

BASE = {"model": "tiny-8l", "pp": 4, "num_microbatches": 8, "micro_batch_size": 1,
        "steps": 3}


def _case(scheme: str, vpp: int) -> CaseConfig:
    case = apply_overrides(CaseConfig(), {**BASE, "vpp": vpp, "scheme": scheme})
    get_scheme(scheme).check(case)
    return case


def _sends(per_rank, axis: str) -> list[float]:
    return [sum(x["wire_bytes"] for x in r["ledger"] if x["op"] == "send" and x["axis"] == axis)
            for r in per_rank]


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_torch_schedule_and_ours_agree(pools, name):
    baseline = f"baseline.torch.pipelining.{name}"
    vpp = 2 if name in ("interleaved", "zbv", "dualpipev") else 1
    theirs, their_ranks = run_on_pool(pools, _case(baseline, vpp))
    ours, our_ranks = run_on_pool(pools, _case(get_scheme(baseline).baseline_of, vpp))
    assert theirs["equivalent"], theirs
    assert ours["equivalent"], ours
    # the same stages cross the same rank boundaries: same bytes per rank, on axis pp
    assert _sends(their_ranks, "pp") == _sends(our_ranks, "pp")
    assert theirs["wire_by_axis"] == ours["wire_by_axis"]
    assert theirs["model_state_bytes"] == ours["model_state_bytes"]


def test_deepspeed_pipeline_engine_agrees(pools):
    """DeepSpeed keeps global groups: it runs on a pool of its own (as the runner does)."""
    from parbench.harness import merge_ranks, run_case
    from parbench.launch import WorkerPool

    case = _case("baseline.deepspeed.pipe", 1)
    assert get_scheme(case.run.scheme).isolated
    with WorkerPool(4) as pool:
        per_rank = pool.run(run_case, case.to_dict(), timeout_s=600)
    names = sorted(get_scheme("pipeline.1f1b").reference(case, 1).params[0])
    theirs = merge_ranks(per_rank, names)
    ours, our_ranks = run_on_pool(pools, _case("pipeline.1f1b", 1))
    assert theirs["equivalent"], theirs
    # DeepSpeed sends on the default group (axis world; world = pp here), one record per
    # message (blocking send is not counted twice), and broadcasts the loss (8 bytes)
    assert _sends(per_rank, "world") == _sends(our_ranks, "pp")
    pred = get_scheme(case.run.scheme).predict(case)
    assert theirs["wire_by_axis"] == pred["wire_bytes_per_rank"]
