"""A framework baseline's known finding (``Scheme.known_finding``): a row that is not
equivalent is labelled FINDING and leaves ``run``'s exit status alone; one that passes is
``pass``; a native row that fails stays FAIL."""
from __future__ import annotations

from parbench.registry import get_scheme
from parbench.report.cells import verdict
from parbench.results.row import Row, RowCase, Verdict


def _row(equivalent: bool, finding: str | None) -> Row:
    return Row(case=RowCase(id="c"), verdict=Verdict(equivalent=equivalent,
                                                     known_finding=finding))


def test_a_known_finding_labels_a_failing_row_and_only_a_failing_one():
    assert verdict(_row(False, "lib x: bug y (scripts/x.py)"), markup=False) == "FINDING"
    assert verdict(_row(False, None), markup=False) == "FAIL"
    assert verdict(_row(True, None), markup=False) == "pass"


def test_only_framework_baselines_declare_findings():
    from parbench.registry import all_schemes
    declared = {n for n, c in all_schemes().items() if c.known_finding}
    assert declared and all(n.startswith("baseline.") for n in declared)
    assert "scripts/yunchang_fp32_repro.py" in get_scheme("baseline.yunchang.usp").known_finding
