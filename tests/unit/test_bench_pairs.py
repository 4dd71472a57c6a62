"""``scripts/bench_all.py``'s pairs (issue 24): every baseline row of the suites beside the
same case run by its native scheme, and the instruments' on / off pair; the summary's ratio is
taken repeat by repeat. No timing is asserted: the figures come from rows built here."""
from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

from parbench.bench_pairs import instrument_pairs, suite_pairs, summarise
from parbench.registry import get_scheme


def _fields(case):
    d = case.to_dict()
    d.pop("id")
    d["run"] = {k: v for k, v in d["run"].items() if k != "scheme"}
    return d


def test_each_baseline_row_of_the_suites_stands_beside_its_native_scheme():
    pairs = suite_pairs(["smoke", "data"])
    theirs = {p.theirs.run.scheme for p in pairs}
    assert {"baseline.torch.ddp", "baseline.torch.fsdp2", "baseline.deepspeed.zero3"} <= theirs
    for p in pairs:
        assert get_scheme(p.theirs.run.scheme).baseline_of == p.ours.run.scheme
        assert _fields(p.ours) == _fields(p.theirs)  # the same case, only the scheme differs
        assert p.ours.run.timed_steps > p.ours.run.warmup_steps
        assert p.ours.id != p.theirs.id
    keys = [p.key for p in pairs]
    assert len(keys) == len(set(keys))


def test_the_instruments_pair_alternates_them_on_the_native_case():
    pairs = instrument_pairs(suite_pairs(["smoke"]))
    assert {p.ours.run.scheme for p in pairs} == {"data.ddp", "zero.3", "pipeline.1f1b"}
    for p in pairs:  # one case whose timed steps alternate the instruments
        assert p.ours.run.instrument and p.ours.run.instrument_ab and p.theirs is p.ours
        native = next(q for q in suite_pairs(["smoke"]) if q.ours.run.scheme == p.ours.run.scheme)
        assert replace(p.ours.run, instrument_ab=False) == native.ours.run


def _rows(*step_s):
    return [SimpleNamespace(time=SimpleNamespace(step_s=s), passed=True) for s in step_s]


def test_the_ratio_is_the_median_of_each_repeats_ratio():
    pair = suite_pairs(["smoke"])[0]
    r = summarise(pair, _rows(1.0, 2.0, 3.0), _rows(2.0, 2.0, 2.0))
    assert (r.ratio, r.low, r.high, r.repeats) == (1.0, 0.5, 1.5, 3)
    assert (r.ours_ms, r.theirs_ms) == (2000.0, 2000.0)


def _verdict_rows(*known):
    """Rows that fail with (a text) or without (None) a known finding."""
    return [SimpleNamespace(time=SimpleNamespace(step_s=1.0), passed=False,
                            verdict=SimpleNamespace(known_finding=k)) for k in known]


def test_a_baselines_known_finding_is_told_from_a_failure():
    pair = suite_pairs(["smoke"])[0]
    ok = _rows(1.0)
    assert summarise(pair, ok, ok).passed is True
    assert summarise(pair, ok, _verdict_rows("yunchang fp32")).passed == "finding"
    assert summarise(pair, ok, _verdict_rows("yunchang fp32", None)).passed is False
    assert "FINDING" in summarise(pair, ok, _verdict_rows("x")).line()


def test_the_goals_lines_count_what_is_above_and_whether_every_repeat_is():
    from parbench.bench_pairs import PairResult, goals

    def r(kind, ratio, low, reason="", error=""):
        return PairResult("p", kind, 1.0, 1.0, ratio, low, 1.2, 5, True, "c", reason=reason,
                          error=error)
    text = goals([r("baseline", 1.05, 0.98), r("baseline", 1.2, 1.1, reason="fused kernel"),
                  r("baseline", 0.9, 0.8), r("instrument", 1.05, 1.04),
                  r("instrument", 1.02, 0.9), r("baseline", 1.0, 1.0, error="RankError: x")])
    assert "1 baseline pair(s) above 1.00x without a reason, 0 above with a measured one" \
        in text and "1 instrument pair(s) above 3% of the step, 1 without a figure" in text
    assert "(a repeat at or below 1.00x)" in text and "(every repeat above 1.03x)" in text


def test_an_instrument_pair_is_held_to_its_cpu_share_where_measured():
    from parbench.bench_pairs import PairResult, goals

    def r(ratio, share, low):
        return PairResult("p", "instrument", 1.0, 1.0, ratio, 0.9, 1.2, 5, True, "c",
                          own_ratio=1.05, share=share, share_low=low, share_high=share + 0.01)
    text = goals([r(1.10, 0.02, 0.01), r(0.98, 0.035, 0.032), r(1.0, 0.04, 0.02)])
    assert "2 instrument pair(s) above 3% of the step" in text
    assert "every run's instruments' CPU above 3%" in text and "CPU 3.5% of the step's" in text
    assert "a run's instruments' CPU at or below 3%" in text
