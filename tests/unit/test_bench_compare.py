"""``parbench compare`` on two ``scripts/bench_all.py --json`` files: the pure functions of
``parbench.report.bench_compare`` on hand-written pairs (the CLI: tests/cli/test_compare.py)."""
from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, fields

import pytest

from parbench.bench_pairs import PairResult
from parbench.config import ConfigError
from parbench.report.bench_compare import (FIGURES, REQUIRED, compare_pairs, diff_pair,
                                           is_bench_file, match_pairs, read_pairs)
from parbench.report.compare import TIME_FLOOR, Options

CASE = "tiny tp1 cp1 ep1 dp2 pp1 fp32 (data)"
NAN = float("nan")


def pair(ratio=0.9, low=0.85, high=0.95, label="data.ddp / baseline.torch.ddp",
         kind="baseline", case=CASE, error="", **kw) -> dict:
    """A PairResult as bench_all's --json writes it (``error``: no figure, NaN ratios)."""
    if error:
        ratio = low = high = NAN
    return asdict(PairResult(label, kind, ours_ms=9.0, theirs_ms=10.0, ratio=ratio, low=low,
                             high=high, repeats=5, passed=True, case=case, error=error, **kw))


def one(old: dict, new: dict, opts: Options | None = None):
    (d,) = compare_pairs([old], [new], opts)
    return d


def test_the_fields_read_are_pair_results_fields():
    names = {f.name for f in fields(PairResult)}
    assert set(REQUIRED) | set(FIGURES) <= names


def test_identical_pairs_are_ok():
    d = one(pair(), pair())
    assert d.status == "ok" and not d.regression and not d.reasons and not d.improvements
    assert d.change == pytest.approx(1.0) and d.overlap and d.threshold == TIME_FLOOR


def test_a_clear_rise_with_ranges_apart_is_a_regression():
    d = one(pair(0.90, 0.85, 0.95), pair(1.10, 1.00, 1.20))
    assert d.regression and d.status == "regression" and d.overlap is False
    assert d.reasons == ["ratio: 0.900× → 1.100× (1.22× > 1.10×; [0.850, 0.950] → "
                         "[1.000, 1.200])"], d.reasons


def test_a_noisy_rise_whose_ranges_overlap_is_not_one():
    d = one(pair(1.00, 0.70, 1.30), pair(1.25, 0.90, 1.50))
    assert d.change == pytest.approx(1.25) and d.overlap is True
    assert not d.regression and not d.reasons


def test_ranges_apart_but_a_rise_within_the_threshold_is_not_one():
    d = one(pair(1.00, 0.98, 1.02), pair(1.05, 1.03, 1.07))
    assert d.overlap is False and not d.regression


def test_a_fall_with_ranges_apart_is_an_improvement():
    d = one(pair(1.10, 1.00, 1.20), pair(0.90, 0.85, 0.95))
    assert not d.regression and d.improvements and d.improvements[0].startswith("ratio: ")


def test_missing_pair_is_a_regression_a_new_one_is_not():
    gone = pair(label="zero.3 / baseline.torch.fsdp2")
    added = pair(label="zero.1 / baseline.deepspeed.zero1")
    diffs = compare_pairs([pair(), gone], [pair(), added])
    assert [(d.label, d.status, d.regression) for d in diffs] == [
        ("data.ddp / baseline.torch.ddp", "ok", False),
        ("zero.3 / baseline.torch.fsdp2", "missing", True),
        ("zero.1 / baseline.deepspeed.zero1", "new", False)]
    assert diffs[1].reasons == ["missing: in OLD, not in NEW"] and diffs[1].new is None


def test_an_error_in_new_is_a_regression_in_old_an_improvement():
    d = one(pair(), pair(error="RuntimeError: rank 1 hung"))
    assert d.regression and d.reasons == ["no figure: RuntimeError: rank 1 hung"]
    assert d.new["ratio"] is None and d.change is None
    d = one(pair(error="RuntimeError: rank 1 hung"), pair())
    assert not d.regression and d.improvements == ["figure: none in OLD"]
    d = one(pair(error="x"), pair(error="y"))
    assert d.status == "ok" and not d.reasons
    # a ratio that is not a number, no error given: no figure either
    assert one(pair(), pair(ratio=NAN)).regression


def test_time_tol_sets_the_threshold_ignore_time_drops_it():
    old, new = pair(1.00, 0.98, 1.02), pair(1.05, 1.03, 1.07)
    assert one(old, new, Options(time_tol=0.02)).regression
    clear = pair(1.10, 1.00, 1.20), pair(1.40, 1.30, 1.50)  # 1.27x, ranges apart
    assert one(*clear).regression
    assert not one(*clear, Options(time_tol=0.3)).regression
    d = one(*clear, Options(ignore_time=True))
    assert not d.regression and d.threshold is None and d.change == pytest.approx(1.4 / 1.1)
    # ignore_time leaves the other rules: an error still gates
    assert one(pair(), pair(error="E"), Options(ignore_time=True)).regression


def test_compares_options_for_rows_are_bad_input():
    for opts in (Options(bytes_tol=0.1), Options(match="config"),
                 Options(gate_baselines=True)):
        with pytest.raises(ConfigError, match="do not apply to bench_all pairs"):
            compare_pairs([pair()], [pair()], opts)


def test_a_repeated_key_is_matched_by_its_order():
    old = [pair(), pair(), pair(kind="instrument", label="data.ddp instruments on / off")]
    new = [pair(), pair(1.10, 1.00, 1.20), pair(kind="instrument",
                                               label="data.ddp instruments on / off")]
    keys = [k for k, _, _ in match_pairs(old, new)]
    assert keys == [("baseline", "data.ddp / baseline.torch.ddp", CASE, 1),
                    ("baseline", "data.ddp / baseline.torch.ddp", CASE, 2),
                    ("instrument", "data.ddp instruments on / off", CASE, 1)]
    diffs = compare_pairs(old, new)
    assert [d.regression for d in diffs] == [False, True, False]
    assert diffs[1].ident == CASE + " #2" and diffs[0].ident == CASE
    # kind is part of the key: the same label and case of the other kind is another pair
    (k, o, n) = match_pairs([pair()], [pair(), pair(kind="instrument")])[1]
    assert o is None and n["kind"] == "instrument"


def test_no_pair_in_common_is_bad_input():
    with pytest.raises(ConfigError, match="no bench pair in common"):
        compare_pairs([pair()], [pair(case="tiny tp2 cp1 ep1 dp1 pp1 fp32 (tensor)")])


def test_to_dict_is_strict_json():
    d = diff_pair(("baseline", "a / b", CASE, 1), pair(), pair(error="E"))
    out = json.loads(json.dumps(d.to_dict(), allow_nan=False))
    assert out["regression"] is True and out["new"]["error"] == "E"
    assert out["old"]["ratio"] == 0.9 and out["new"]["low"] is None


def test_read_pairs_reads_bench_alls_file_and_rejects_bad_ones(tmp_path):
    f = tmp_path / "bench.json"
    f.write_text(json.dumps([pair(), pair(error="E")], indent=1))  # NaN, as bench_all writes
    got = read_pairs(f, "OLD")
    assert is_bench_file(f) and len(got) == 2 and math.isnan(got[1]["ratio"])
    rows = tmp_path / "results.jsonl"
    rows.write_text('{"id": "x"}\n')
    assert not is_bench_file(rows) and not is_bench_file(tmp_path)
    assert not is_bench_file(tmp_path / "nope.json")
    for text, message in (("[", "is not JSON"), ("[]", "has no pairs"),
                          ("[1]", "entry 1 is not a bench_all pair"),
                          (json.dumps([pair(), {"kind": "baseline", "ratio": 1}]),
                           "entry 2 is not a bench_all pair .no 'label'"),
                          (json.dumps([pair(ratio="fast")]), "ratio='fast' must be a number"),
                          (json.dumps([pair(error=3)]), "error=3 must be a string")):
        f.write_text(text)
        with pytest.raises(ConfigError, match=f"NEW={re.escape(str(f))}.*{message}"):
            read_pairs(f, "NEW")


def test_pairs_carrying_bench_alls_key_match_by_it_in_any_order():
    """Two pairs of one (kind, label, case) text told apart by their cases' key: swapped in
    NEW, each still meets its own OLD pair (by order alone the rise would land on the
    wrong one)."""
    old = [pair(0.90, 0.85, 0.95, key="baseline:aaa"), pair(0.50, 0.45, 0.55, key="baseline:bbb")]
    new = [pair(0.50, 0.45, 0.55, key="baseline:bbb"), pair(0.90, 0.85, 0.95, key="baseline:aaa")]
    assert not any(d.regression for d in compare_pairs(old, new))
    by_order = [{**p, "key": ""} for p in new]
    assert any(d.regression for d in compare_pairs(old, by_order))
