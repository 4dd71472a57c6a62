"""``instrument_ab`` (issue 24): the timed steps alternate the ledger and timeline, so that the
instruments' cost is measured on the same ranks and placement (``scripts/bench_all.py``'s
instrument pairs). A step without them records no traffic and is left out of the timed-ledger
check; the steps with them are checked as before."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from parbench.bench_ab import ab_steps
from parbench.config import CaseConfig, ConfigError, validate_run
from parbench.harness import instrumented
from parbench.overrides import apply_overrides
from parbench.runner import case_row


def _case(**kw):
    return apply_overrides(CaseConfig(), {"scheme": "data.ddp", "model": "tiny", "dp": 2,
                                          "steps": 2, "timed_steps": 6, "warmup_steps": 1,
                                          "instrument_ab": True, **kw})


def test_every_other_timed_step_runs_without_the_instruments():
    run = _case().run
    assert [instrumented(run, s) for s in range(8)] == [True, True, True, False, True,
                                                        False, True, False]
    plain = _case(instrument_ab=False).run
    assert all(instrumented(plain, s) for s in range(8))


@pytest.mark.parametrize("fields", [{"instrument": False}, {"timed_steps": 2}])
def test_it_needs_the_instruments_and_two_timed_steps_past_the_warm_up(fields):
    with pytest.raises(ConfigError, match="instrument_ab"):
        validate_run(_case(**fields).run)


def test_a_row_keeps_its_verdict_and_pairs_its_steps(pools):
    row = case_row(_case(), pools(2))
    assert row.passed and row.verdict.timed_ok is True  # the instrumented timed steps
    on, off = ab_steps(row)
    assert len(on) == len(off) == 2  # timed steps 3..7 after the warm-up: (4, 5), (6, 7)


def test_the_steps_are_paired_by_their_place_after_the_warm_up():
    row = SimpleNamespace(time=SimpleNamespace(per_rank_s=[[1, 2, 3, 4, 5], [1, 9, 3, 4, 5]]),
                          case=SimpleNamespace(config={"run": {"warmup_steps": 1}}))
    # entries are timed steps 1..5 (after the warm-up): 2 and 4 with the instruments, each
    # paired with the next; the slowest rank's seconds per step
    assert ab_steps(row) == ([9, 4], [3, 5])


def test_the_instruments_share_is_their_own_thread_cpu_over_the_steps():
    from parbench.bench_ab import own_ratios, shares
    # two ranks, timed steps 1..5 after a warm-up of 1: steps 2 and 4 with the instruments
    t = SimpleNamespace(per_rank_s=[[1] * 5, [1] * 5],
                        per_rank_own_cpu_s=[[0, 3, 2, 3, 2], [0, 3, 2, 5, 2]],
                        per_rank_cpu_s=[[0, 9, 10, 9, 10], [0, 9, 10, 9, 30]])
    row = SimpleNamespace(time=t, case=SimpleNamespace(config={"run": {"warmup_steps": 1}}))
    assert shares(row) == [(6 - 4) / 20, (8 - 4) / 40]
    assert own_ratios(row) == [6 / 4, 8 / 4]


def test_a_real_rows_instruments_cost_some_cpu_and_a_share_below_one(pools):
    from parbench.bench_ab import shares
    row = case_row(_case(timed_steps=10), pools(2))
    s = shares(row)
    assert len(s) == 4 and all(-1 < x < 1 for x in s)
