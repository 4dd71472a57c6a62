"""A full parameter copy held in a ``functools.partial``, a closure cell or a bound method is
measured by the memory tracker on real ranks: ``other`` equals the copy's bytes on every rank
and checked step, and the case fails against data.ddp's closed form (other = 0); the same
scheme without the copy passes (issue 20, sec. 7)."""
from __future__ import annotations

from pathlib import Path

import pytest

from parbench.config import CaseConfig
from parbench.model import build_model
from parbench.overrides import apply_overrides
from parbench.runner import case_row

SCHEMES = Path(__file__).with_name("leaky_schemes.py")


def _case(cls_name: str) -> CaseConfig:
    return apply_overrides(CaseConfig(), {"scheme": f"{SCHEMES}:{cls_name}", "model": "tiny",
                                          "dp": "2", "steps": "2", "timed_steps": "0"})


def _param_bytes(case: CaseConfig) -> int:
    return sum(p.numel() * p.element_size()
               for p in build_model(case.model, case.run.seed).parameters())


@pytest.mark.parametrize("holder", ["Clean", "InPartial", "InClosure", "InBoundMethod"])
def test_a_copy_in_a_callable_is_measured_as_other(pools, holder):
    case = _case(holder)
    row = case_row(case, pools(2))
    copy = 0 if holder == "Clean" else _param_bytes(case)
    assert [s["other"] for s in row.memory.states.measured] == [copy, copy], \
        row.memory.states.measured
    assert row.verdict.equivalent  # the numbers are right: only the states give it away
    assert row.memory.states.exact is (holder == "Clean")
    assert row.passed is (holder == "Clean")
