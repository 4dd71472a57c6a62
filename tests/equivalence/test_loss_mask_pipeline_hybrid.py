"""A loss mask (``loss_mask``) in the synchronous native pipeline schedules: the last stage
scales each micro-batch's mean token loss by n_mb / N (n_mb: its counted tokens, N: the
global batch's; Megatron-LM's --calculate-per-token-loss) and equals the golden run; the
schemes that do not normalise so yet refuse the field before spawning (the hybrid's masked
loss: tests/equivalence/test_hybrid_features.py)."""
from __future__ import annotations

import pytest

from parbench.config import CaseConfig, ConfigError
from parbench.overrides import apply_overrides
from parbench.registry import get_scheme
from tests.helpers import run_on_pool

BASE = {"model": "tiny-4l", "pp": "2", "num_microbatches": "4", "steps": "3",
        "timed_steps": "1", "loss_mask": "0.6"}


def case_for(scheme: str, **extra) -> CaseConfig:
    case = apply_overrides(CaseConfig(), {**BASE, "scheme": scheme, **extra})
    get_scheme(scheme).check(case)
    return case


@pytest.mark.parametrize("scheme,extra", [("pipeline.1f1b", {}), ("pipeline.zb-h1", {}),
                                          ("pipeline.interleaved", {"vpp": "2"})])
def test_the_pipeline_family_normalises_by_the_global_token_count(pools, scheme, extra):
    merged, _ = run_on_pool(pools, case_for(scheme, **extra))
    assert merged.equivalent, merged.first_failure


@pytest.mark.parametrize("scheme", ["pipeline.bpipe"])
def test_schemes_that_do_not_normalise_refuse_before_spawning(scheme):
    case = apply_overrides(CaseConfig(), {**BASE, "scheme": scheme})
    with pytest.raises(ConfigError, match="loss_mask=0.6"):
        get_scheme(scheme).check(case)
