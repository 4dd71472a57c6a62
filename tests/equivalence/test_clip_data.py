"""Gradient clipping by global norm (``clip_grad``; issue 20, sec. 3) in the data family:
native DDP and ZeRO-1/2/3 clip the gradients they step on and report, equal to the golden run
clipped the same way, with the norm's all-reduce over dp (ZeRO's shards) in their closed
forms; torch DDP, FSDP2 and DeepSpeed clip with their own machinery on the same case.

The tiny model's gradient norm is about 1.0, so ``clip_grad=0.5`` clips every checked step;
the row records on how many steps the clip acted (``clipped_steps``), and a threshold above
the norm leaves every step unclipped -- the figure the reader uses to know the row tests the
clip at all."""
from __future__ import annotations

import pytest

from parbench.config import CaseConfig, ConfigError
from parbench.overrides import apply_overrides
from parbench.registry import get_scheme
from tests.helpers import assert_wire_and_calls_per_step, run_on_pool

BASE = {"model": "tiny", "dp": "2", "num_microbatches": "2", "steps": "3", "timed_steps": "1",
        "bucket_mb": "0.002", "clip_grad": "0.5"}


def case_for(scheme: str, **extra) -> CaseConfig:
    case = apply_overrides(CaseConfig(), {**BASE, "scheme": scheme, **extra})
    get_scheme(scheme).check(case)
    return case


@pytest.mark.parametrize("scheme", ["data.ddp", "zero.1", "zero.2", "zero.3"])
def test_native_schemes_clip_as_the_golden_run_with_their_closed_forms(pools, scheme):
    case = case_for(scheme)
    merged, per_rank = run_on_pool(pools, case)
    assert merged.equivalent, merged.first_failure
    assert merged.clipped_steps == case.run.steps and merged.clip_coef_min < 0.6
    pred = get_scheme(scheme).predict(case)
    assert_wire_and_calls_per_step(pred, per_rank)
    norm_calls = 0 if scheme == "data.ddp" else 1  # ZeRO's shards: one 4-byte all-reduce
    unclipped = get_scheme(scheme).predict(case_for(scheme, clip_grad="0"))
    assert pred.calls_at(0)[0]["dp"] - unclipped.calls_at(0)[0]["dp"] == norm_calls


def test_a_threshold_above_the_norm_never_clips_and_the_row_says_so(pools):
    merged, _ = run_on_pool(pools, case_for("zero.2", clip_grad="100"))
    assert merged.equivalent and merged.clipped_steps == 0 and merged.clip_coef_min == 1.0


@pytest.mark.parametrize("scheme", ["baseline.torch.ddp", "baseline.torch.fsdp2"])
def test_torch_baselines_clip_with_torch_clip_grad_norm(pools, scheme):
    merged, _ = run_on_pool(pools, case_for(scheme))
    assert merged.equivalent, merged.first_failure
    assert merged.clipped_steps == 3


def test_deepspeed_clips_with_its_gradient_clipping(pools):
    pytest.importorskip("deepspeed")
    merged, _ = run_on_pool(pools, case_for("baseline.deepspeed.zero2"))
    assert merged.equivalent, merged.first_failure
    assert merged.clipped_steps == 3


@pytest.mark.parametrize("scheme", ["data.local_sgd", "baseline.torch.pipelining.1f1b"])
def test_schemes_that_do_not_clip_refuse_before_spawning(scheme):
    with pytest.raises(ConfigError, match="clip_grad=0.5"):
        get_scheme(scheme).check(apply_overrides(CaseConfig(), {**BASE, "scheme": scheme}))
