"""The self-test's bookkeeping (``parbench.mutation``): a mutant killed by a crash or refused
before running is reported as such, never as a kill by a check, and fails the exit status;
the ``ci`` sample holds a mutant of every scheme that has mutants. And the bug that is no
longer a mutant because no rank can run it: a W placed before its B, refused by the schedule
validator before anything spawns (issue 20, sec. 7)."""
from __future__ import annotations

import pytest

from parbench.mutation import (OUTCOMES, ci_sample, exit_status, outcome, stratum, summary,
                               summary_line)
from parbench.results import Row
from parbench.results.row import RowCase
from parbench.results.rank import Failure
from parbench.schedules import ScheduleError, make_schedule, validate
from parbench.schedules.actions import BACKWARD_WEIGHT, Schedule
from parbench.selftest import CI_SUBSET, Mutant
from parbench.selftest.catalogue import load


def _row(status="ok", equivalent=True, failure=None, wire_exact=None) -> Row:
    row = Row(case=RowCase(id="case"))
    row.verdict.status, row.verdict.equivalent, row.verdict.failure = status, equivalent, \
        failure
    row.traffic.wire_exact = wire_exact
    return row


TRACEBACK = "Traceback (most recent call last):\n  File \"x.py\", line 1\n{}\n"


@pytest.mark.parametrize("row, expected", [
    (_row(), "survived"),
    (_row(equivalent=False), "check"),
    (_row(wire_exact=False), "check"),
    (_row("failed", failure=Failure("crashed", 1, "rank 1 failed: RuntimeError: size",
                                    TRACEBACK.format("RuntimeError: Received data size"))),
     "crash"),
    (_row("failed", failure=Failure("hung", -1, "hung: rank 0", "no progress for 60 s")),
     "crash"),
    (_row("failed", failure=Failure("crashed", 0, "rank 0 failed", TRACEBACK.format(
        "parbench.layout.ConfigError: vhalf: W(mb=0) runs before its B"))), "refused"),
    (_row("failed", failure=Failure("crashed", 0, "rank 0 failed", TRACEBACK.format(
        "parbench.schedules.actions.ScheduleError: W before B"))), "refused"),
    (_row("failed", failure=Failure("refused", -1, "ConfigError: tp=3")), "refused"),
])
def test_each_row_has_one_outcome_and_only_a_failed_check_is_a_kill(row, expected):
    assert outcome(row) == expected


def _entry(i: int, how: str) -> dict:
    return {"id": f"m{i}", "base": f"s{i % 2}", "outcome": how}


@pytest.mark.parametrize("outcomes, false_alarms, status", [
    (["check", "check"], 0, 0),
    (["check", "crash"], 0, 1),
    (["check", "refused"], 0, 1),
    (["check", "survived"], 0, 3),
    (["crash", "survived"], 0, 3),
    (["check", "check"], 1, 3),
])
def test_the_exit_status_counts_only_kills_by_a_check(outcomes, false_alarms, status):
    controls = {("s0", (), s): _row(equivalent=s > false_alarms) for s in range(1, 3)}
    result = summary([_entry(i, o) for i, o in enumerate(outcomes)], controls, seeds=2)
    assert exit_status(result) == status
    assert sum(result[k] for k in ("killed_by_check", "killed_by_crash", "refused",
                                   "survived")) == len(outcomes)
    line = summary_line(result)
    assert f"{outcomes.count('check')} killed by a check, {outcomes.count('crash')} by a " \
           f"crash, {outcomes.count('refused')} refused before running" in line, line


def test_outcomes_are_the_four_the_docs_name():
    assert OUTCOMES == ("check", "crash", "refused", "survived")


def test_the_ci_sample_holds_every_scheme_with_mutants_and_the_kinds_of_check():
    catalogue = load()
    sample = ci_sample(catalogue)
    assert len(sample) == len(set(sample))
    strata = {stratum(m.base) for m in catalogue.values()}
    assert {stratum(catalogue[i].base) for i in sample} == strata
    # every native scheme is its own stratum; a framework's baselines are one
    assert {m.base for m in catalogue.values() if not m.base.startswith("baseline.")} <= strata
    assert set(CI_SUBSET) <= set(sample)
    assert sample == ci_sample(dict(catalogue))  # the same on every run
    # a new scheme's mutants join the sample without touching CI_SUBSET
    extra = dict(catalogue, **{"new-bug": Mutant("new-bug", "pipeline.brand-new", "a bug")})
    assert "new-bug" in ci_sample(extra)


def _w_before_b(schedule: Schedule) -> Schedule:
    """The W filler's bug: each W goes to the slot just before its B."""
    rows = []
    for row in schedule.actions:
        out = [a for a in row if a.kind != BACKWARD_WEIGHT]
        for w in (a for a in row if a.kind == BACKWARD_WEIGHT):
            b = next(i for i, a in enumerate(out) if a.kind == "B" and a.mb == w.mb
                     and a.stage == w.stage)
            out.insert(b, w)
        rows.append(out)
    return Schedule(name=schedule.name, p=schedule.p, m=schedule.m, v=schedule.v,
                    num_stages=schedule.num_stages, placement=schedule.placement,
                    mb_pipe=schedule.mb_pipe, actions=rows, split_backward=True)


@pytest.mark.parametrize("name", ["vhalf", "vmin", "zb-h1"])
def test_a_w_before_its_b_is_refused_by_the_validator(name):
    right = make_schedule(name, 2, 4, 2 if name != "zb-h1" else None)
    validate(right)
    with pytest.raises(ScheduleError):
        validate(_w_before_b(right))


def test_a_skipped_mutant_is_neither_a_kill_nor_a_failure():
    controls = {("s0", (), 1): _row()}
    result = summary([_entry(0, "check"), _entry(1, "skipped")], controls, seeds=1)
    assert (result["killed_by_check"], result["skipped"], exit_status(result)) == (1, 1, 0)
    assert "survived, 1 skipped (framework not installed)" in summary_line(result)


def test_a_mutant_of_an_unavailable_framework_is_skipped_with_its_reason(monkeypatch):
    """Where megatron-core is missing its mutants are skipped, saying why, before any rank
    runs (here its absence is simulated)."""
    from impls.baselines.megatron_gpt import MegatronCoreGPTScheme
    from parbench.mutation import run_selftest
    monkeypatch.setattr(MegatronCoreGPTScheme, "unavailable",
                        classmethod(lambda cls: "megatron-core is not importable"))
    seen = []
    result = run_selftest("full", 1, ["mcore-gpt-fc1-halves-swapped"],
                          lambda kind, m, why: seen.append((kind, m.id, why)))
    assert seen == [("skipped", "mcore-gpt-fc1-halves-swapped",
                     "megatron-core is not importable")]
    assert (result["skipped"], result["controls"], exit_status(result)) == (1, 0, 0)
    assert result["cases"][0]["skipped_because"] == "megatron-core is not importable"
