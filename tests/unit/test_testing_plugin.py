"""``parbench.testing``, mostly without ranks: the cases its strategies draw, how a case and
a scheme are named, the failure messages built from (synthetic) per-rank results; one test on
the session's 2-rank pool (a module the ranks must import). The helpers on real ranks are
exercised by the example package's tests (``examples/my_ddp/tests``)."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from parbench.config import ConfigError, validate_case
from parbench.results import FirstFailure, RankResult, StepCheck
from parbench.registry import get_scheme
from parbench.testing import (FAMILIES, BytesDiffer, NotEquivalent, SchemeRun, _figure_diffs,
                              assert_equivalent, bytes_report, cases, equivalence_report,
                              make_case, native_scheme, scheme_spec)
from parbench.verdict import merge_ranks

from impls.data.ddp import NativeDDP

DEGREES = ("tp", "cp", "ep", "dp", "pp")


class OneMicrobatchDDP(NativeDDP):
    """A user's scheme (not registered) that refuses gradient accumulation."""

    name = ""

    @classmethod
    def check(cls, case):
        super().check(case)
        if case.layout.num_microbatches != 1:
            raise ConfigError("num_microbatches must be 1")


@pytest.mark.parametrize("family", sorted(FAMILIES))
@given(data=st.data())
def test_cases_are_valid_small_cases_of_their_family(family, data):
    case = data.draw(cases(family))
    validate_case(case)
    cls = get_scheme(case.run.scheme)
    assert cls.family == family and case.run.scheme == native_scheme(cls.name)
    cls.check(case)
    assert case.layout.world_size <= 4 and case.run.steps == 3 and case.run.timed_steps == 1
    assert case.layout.num_microbatches >= 2 and case.model.vocab_size % 2 == 1
    assert case.model.name in ("tiny", "tiny-4l", "tiny-8l", "llama-tiny") and case.id


class UntiedDDP(NativeDDP):
    """A user's scheme (not registered) that refuses tied embeddings."""

    name = ""

    @classmethod
    def check(cls, case):
        super().check(case)
        if case.model.tie_embeddings:
            raise ConfigError("tie_embeddings must be false")


@given(data=st.data())
def test_cases_take_fixed_fields_strategies_and_a_scheme(data):
    case = data.draw(cases("data", dp=2, bucket_mb=st.sampled_from([0.5, 1.0]),
                           scheme=UntiedDDP))
    assert case.layout.dp == 2 and case.options.data.bucket_mb in (0.5, 1.0)
    assert not case.model.tie_embeddings  # the scheme's check filters the draws
    assert case.run.scheme == f"{__name__}:UntiedDDP"


@given(data=st.data())
def test_cases_fields_reach_a_scheme_no_default_case_suits(data):
    """A scheme that refuses every default case (all have >= 2 micro-batches) is drawn the
    default set's cases with the fixed fields applied."""
    case = data.draw(cases("data", num_microbatches=1, scheme=OneMicrobatchDDP))
    assert case.layout.num_microbatches == 1 and case.layout.dp in (2, 3)


def test_unknown_family_is_an_error():
    with pytest.raises(ValueError, match="family='nope'"):
        cases("nope")


def test_make_case_defaults_fields_and_bad_input():
    case = make_case(NativeDDP, dp=2, num_microbatches=2, sp=False)
    assert (case.model.name, case.run.timed_steps, case.run.scheme) == ("tiny", 0, "data.ddp")
    assert (case.layout.dp, case.layout.num_microbatches) == (2, 2)
    again = make_case(NativeDDP, case=case, steps=1)  # a given case keeps its fields
    assert (again.layout.dp, again.run.steps) == (2, 1)
    with pytest.raises(ConfigError, match="num_heads"):
        make_case(NativeDDP, tp=3)
    with pytest.raises(ConfigError, match="tp=2 is not used"):
        make_case(NativeDDP, tp=2)  # the scheme's own check


def test_scheme_spec(tmp_path):
    assert scheme_spec(NativeDDP) == "data.ddp"  # parbench's own: its registered name
    assert scheme_spec("my.mod:Cls") == "my.mod:Cls"
    assert scheme_spec(OneMicrobatchDDP) == f"{__name__}:OneMicrobatchDDP"
    assert get_scheme(scheme_spec(OneMicrobatchDDP)) is OneMicrobatchDDP

    def local():
        class Inner(NativeDDP):
            pass
        return Inner
    with pytest.raises(TypeError, match="top level"):
        scheme_spec(local())
    with pytest.raises(TypeError):
        scheme_spec(object)
    path = tmp_path / "by_path.py"  # loaded by its file path: named by it again
    path.write_text("from impls.data.ddp import NativeDDP\n\n\nclass Mine(NativeDDP):\n"
                    "    name = ''\n")
    assert scheme_spec(get_scheme(f"{path}:Mine")) == f"{path.resolve()}:Mine"


def _check(step, *, grad=1e-8, grad_ok=True, failure=None, loss=4.5, update=0.0):
    return StepCheck(step=step, grad_max_abs=grad, grad_ok=grad_ok, param_max_abs=1e-6,
                     param_ok=True, names=["w"], loss=loss, golden_loss=4.5, loss_abs=0.0,
                     loss_ok=True, update_excess=update, update_ok=update <= 1.0,
                     stepwise=True, **({"failure": failure} if failure else {}))


def _rank(rank, checks, wire=None, calls=None):
    n = len(checks)
    return RankResult(rank=rank, losses=[c.loss for c in checks], checks=checks,
                      step_times=[], peak_bytes=None, model_states_per_step=[{}] * n,
                      wire_by_axis_per_step=[dict(wire or {"dp": 1024.0})] * n,
                      calls_by_axis_per_step=[dict(calls or {"dp": 1})] * n, ledger=[],
                      timeline=[])


def _run(per_rank):
    return SchemeRun("my.mod:Cls", make_case(None, dp=2, steps=2), merge_ranks(per_rank, ["w"]),
                     per_rank)


def test_not_equivalent_names_step_rank_tensor_and_tolerance():
    failure = FirstFailure("gradient", "blocks.0.ln1.weight", max_abs=0.01, tolerance=1.01e-6)
    per_rank = [_rank(0, [_check(0), _check(1)]),
                _rank(1, [_check(0), _check(1, grad=0.01, grad_ok=False, failure=failure)])]
    result = _run(per_rank)
    assert not result.equivalent
    text = equivalence_report(result)
    assert issubclass(NotEquivalent, AssertionError)
    assert "my.mod:Cls is not equivalent" in text
    assert ("first failure: step 1, rank 1: gradient 'blocks.0.ln1.weight': max|ours - "
            "golden| = 0.01 > tolerance 1.01e-06") in text
    assert "dp=2" in text and "rtol 1e-05, atol 1e-06" in text
    rows = [line for line in text.splitlines() if line.strip().startswith(("0 ", "1 "))]
    assert len(rows) == 4 and rows[-1].endswith("<- gradient") and "4.50000000" in rows[0]


def test_not_equivalent_without_recorded_failure_says_what_is_known():
    """Records without the failing tensor's name (older parbench): the step, rank, check
    and largest difference, and that the tensor is not recorded."""
    per_rank = [_rank(0, [_check(0, update=37.0)]), _rank(1, [_check(0)])]
    for c in per_rank[0].checks:
        c.failure = None
    result = _run(per_rank)
    if getattr(result.merged, "first_failure", None) is not None:
        result.merged.first_failure = None
    text = equivalence_report(result)
    assert "first failure: step 0, rank 0: update '(optimizer step)': the step is 37 x" in text


def test_bytes_differ_table():
    per_rank = [_rank(0, [_check(0)], wire={"dp": 1000.0}, calls={"dp": 3}),
                _rank(1, [_check(0)], wire={"dp": 1024.0}, calls={"dp": 1})]
    result = _run(per_rank)
    predicted = [{"dp": 1024.0}, {"dp": 1024.0}]
    kinds = [("bytes", result.merged.wire_by_step, lambda s: predicted, 0.5),
             ("calls", result.merged.calls_by_step, lambda s: [{"dp": 1}, {"dp": 1}], 0)]
    diffs = _figure_diffs(kinds, 1)
    assert diffs == [(0, 0, "dp", "bytes", 1000.0, 1024.0), (0, 0, "dp", "calls", 3.0, 1.0)]
    text = bytes_report(result, "data.ddp's closed form", diffs, ["bytes", "calls"])
    assert issubclass(BytesDiffer, AssertionError)
    assert "measured bytes and calls differ from data.ddp's closed form" in text
    lines = text.splitlines()
    assert any(line.split()[:6] == ["0", "dp", "bytes", "1,000", "1,024", "-24"]
               for line in lines)
    assert any(line.split()[:5] == ["1", "dp", "bytes", "1,024", "1,024"] for line in lines)


def test_the_plugin_is_loaded(request, parbench_pool):
    """The ``pytest11`` entry point (parbench installed) brings the fixture; asking for it
    starts no ranks."""
    assert request.config.pluginmanager.hasplugin("parbench")
    assert callable(parbench_pool)


def test_ranks_import_what_the_test_process_can(tmp_path, monkeypatch, parbench_pool):
    """The one test here on ranks: a module put on sys.path after the session's pool started
    (spawned ranks copy sys.path when they start) is still found by the ranks."""
    parbench_pool(2)  # started before the module's directory is on the path
    (tmp_path / "late_user_scheme.py").write_text(
        "from impls.data.ddp import NativeDDP\n\n\nclass LateDDP(NativeDDP):\n    name = ''\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    result = assert_equivalent("late_user_scheme:LateDDP", dp=2, steps=1)
    assert result.equivalent and result.case.run.scheme == "late_user_scheme:LateDDP"
