"""Multi-head latent attention (``parbench.model.mla``) under the native Megatron 1D scheme
and its sequence-parallel form (``impls.tensor.megatron_mla``: down projections duplicated,
up projections column-parallel over heads, output projection row-parallel) against the
golden run; every step's bytes and calls equal the closed forms
(``analytic.tensor.mla_layer_traffic``, ``mla_sp_layer_traffic``). What it cannot run is
refused before spawning."""
from __future__ import annotations

import pytest

from parbench.config import CaseConfig, ConfigError, validate_case
from parbench.overrides import apply_overrides
from parbench.registry import get_scheme
from tests.helpers import assert_wire_and_calls_per_step, run_on_pool

TP = {"model": "mla-tiny", "dp": "1", "tp": "2", "num_microbatches": "2", "steps": "2",
      "timed_steps": "1"}


def case_for(scheme: str, **extra) -> CaseConfig:
    case = apply_overrides(CaseConfig(), {**TP, "scheme": scheme, **extra})
    validate_case(case)
    get_scheme(scheme).check(case)
    return case


@pytest.mark.parametrize("scheme,extra", [
    ("tensor.megatron", {}),
    ("tensor.megatron", {"q_lora_rank": "0", "recompute": "full"}),
    ("tensor.megatron-sp", {}),
    ("tensor.megatron-sp", {"q_lora_rank": "0", "recompute": "full"})])
def test_megatron_trains_latent_attention(pools, scheme, extra):
    case = case_for(scheme, **extra)
    merged, per_rank = run_on_pool(pools, case)
    assert merged.equivalent, merged.first_failure
    assert_wire_and_calls_per_step(get_scheme(scheme).predict(case), per_rank)


@pytest.mark.parametrize("scheme,extra,words", [
    ("tensor.megatron", {"recompute": "selective"}, "recompute=selective"),
    # the token-slice pipelines' cached-key attention reads multi-head heads (data and the
    # other pipelines run MLA: tests/equivalence/test_data.py, test_pipeline.py)
    ("pipeline.seq1f1b", {"tp": "1", "pp": "2", "num_microbatches": "2"},
     "kv_lora_rank=16: scheme pipeline.seq1f1b")])
def test_what_is_not_run_is_refused(scheme, extra, words):
    with pytest.raises(ConfigError, match=words):
        case_for(scheme, **extra)
