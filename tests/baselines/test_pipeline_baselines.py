"""torch.distributed.pipelining and DeepSpeed's pipeline engine against our executor on the
same cases: both equal the golden run and put the same point-to-point bytes on the wire."""
from __future__ import annotations

import pytest

from parbench.config import CaseConfig
from parbench.overrides import apply_overrides
from parbench.schedules import SCHEDULES, ChunkRule
from parbench.registry import get_scheme
from tests.helpers import run_on_pool

from impls.baselines.torch_pipelining import TORCH_SCHEDULES

BASE = {"model": "tiny-8l", "pp": 4, "num_microbatches": 8, "micro_batch_size": 1,
        "steps": 3}


def _case(scheme: str, vpp: int) -> CaseConfig:
    case = apply_overrides(CaseConfig(), {**BASE, "vpp": vpp, "scheme": scheme})
    get_scheme(scheme).check(case)
    return case


def _model_states(states: dict[str, int]) -> dict[str, int]:
    return {k: states.get(k, 0) for k in ("params", "grads", "optimizer")}


def _sends(per_rank, axis: str) -> list[float]:
    return [sum(x["wire_bytes"] for x in r.ledger if x["op"] == "send" and x["axis"] == axis)
            for r in per_rank]


@pytest.mark.parametrize("name", list(TORCH_SCHEDULES))
def test_torch_schedule_and_ours_agree(pools, name):
    baseline = f"baseline.torch.pipelining.{name}"
    ours_name = TORCH_SCHEDULES[name][1]
    # two chunks per rank where our matching schedule holds more than one
    ours_spec = SCHEDULES[ours_name.split(".", 1)[1]]
    vpp = 1 if ours_spec.chunks is ChunkRule.ONE else 2
    theirs, their_ranks = run_on_pool(pools, _case(baseline, vpp))
    ours, our_ranks = run_on_pool(pools, _case(ours_name, vpp))
    assert theirs.equivalent, theirs
    assert ours.equivalent, ours
    # the same stages cross the same rank boundaries: same bytes per rank, on axis pp
    assert _sends(their_ranks, "pp") == _sends(our_ranks, "pp")
    assert theirs.wire_by_axis == ours.wire_by_axis
    # the same model states; torch's stages also keep their p2p buffers (category "other")
    assert [_model_states(s) for s in theirs.model_state_bytes] == \
        [_model_states(s) for s in ours.model_state_bytes]


def test_deepspeed_pipeline_engine_agrees(pools):
    """DeepSpeed keeps global groups: it runs on a pool of its own (as the runner does)."""
    case = _case("baseline.deepspeed.pipe", 1)
    assert get_scheme(case.run.scheme).isolated
    theirs, per_rank = run_on_pool(pools, case)  # a fresh pool: the scheme is isolated
    ours, our_ranks = run_on_pool(pools, _case("pipeline.1f1b", 1))
    assert theirs.equivalent, theirs
    # DeepSpeed sends on the default group (axis world; world = pp here), one record per
    # message (blocking send is not counted twice), and broadcasts the loss (8 bytes)
    assert _sends(per_rank, "world") == _sends(our_ranks, "pp")
    pred = get_scheme(case.run.scheme).predict(case)
    assert theirs.wire_by_axis == pred.wire_bytes
