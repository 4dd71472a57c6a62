"""Every registered scheme either computes in ``dtype=bf16`` or refuses it in ``check``,
before anything spawns (issue 20, sec. 8: ``data.ddp dtype=bf16`` ran fp32 silently). The
schemes that accept bf16 are exactly those whose bf16 runs are tested against the golden run
(tests/equivalence/test_data.py, test_hybrid.py and the data suite's baselines): a new scheme
that neither runs bf16 nor refuses it fails here."""
from __future__ import annotations

import pytest

from parbench.config import ConfigError, with_changes
from parbench.registry import all_schemes, get_scheme
from parbench.selftest import FAMILY_CASES
from parbench.overrides import apply_overrides
from parbench.config import CaseConfig
from parbench.suites import available_suites, load_suite

#: the schemes that compute in bf16 (fp32 masters), each with a bf16 test or suite row
RUN_BF16 = {"zero.1", "zero.2", "zero.3", "hybrid", "baseline.torch.fsdp2",
            "baseline.deepspeed.zero1", "baseline.deepspeed.zero2", "baseline.deepspeed.zero3"}


def _fp32_cases() -> dict[str, CaseConfig]:
    """One fp32 case each scheme accepts: from the suites, else its family's small case."""
    out: dict[str, CaseConfig] = {}
    for name in available_suites():
        if name == "papers":
            continue
        for case in load_suite(name).cases:
            if case.run.dtype == "fp32" and case.run.scheme not in out:
                try:
                    get_scheme(case.run.scheme).check(case)
                except ConfigError:
                    continue
                out[case.run.scheme] = case
    for name, cls in all_schemes().items():
        if name not in out and cls.family in FAMILY_CASES:
            case = apply_overrides(CaseConfig(), {**FAMILY_CASES[cls.family], "scheme": name})
            try:
                cls.check(case)
            except ConfigError:
                continue
            out[name] = case
    return out


CASES = _fp32_cases()


def test_every_scheme_has_a_case_it_accepts_in_fp32():
    # a framework not installed here (torchtitan is an optional extra) refuses every case
    # with its reason; it is checked where it is installed
    absent = {n for n, cls in all_schemes().items() if cls.unavailable()}
    assert sorted(set(all_schemes()) - set(CASES) - absent) == []


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_scheme_runs_bf16_or_refuses_it_before_spawning(name):
    case = with_changes(CASES[name], run={"dtype": "bf16"})
    try:
        get_scheme(name).check(case)
    except ConfigError as e:
        assert name not in RUN_BF16, f"{name} runs bf16 but refused it: {e}"
        assert "dtype" in str(e), str(e)
        return
    assert name in RUN_BF16, f"{name} accepts dtype=bf16 but is not known to compute in it"
