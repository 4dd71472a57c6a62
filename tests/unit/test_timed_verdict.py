"""The timed steps' verdict (issue 20, section 1), as pure functions on merged figures: each
timed step's ledger is held to the closed form where it predicts that step and the checked
steps follow it, else to the last checked step's ledger; the first difference names its step,
rank and axis; the final state's failure comes after the checked steps' and after a timed
ledger's at the same step. Rank runs are in tests/cli/test_verify_timed.py."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from parbench.config import CaseConfig
from parbench.overrides import apply_overrides
from parbench.results import FirstFailure, RankResult, StepCheck
from parbench.scheme import Prediction
from parbench.verdict import merge_ranks, timed_ledger
from parbench.verdict.verdict import _earliest

DP = {"dp": 1000.0}


def case(steps=3, timed=3, instrument="true"):
    return apply_overrides(CaseConfig(), {"steps": str(steps), "timed_steps": str(timed),
                                          "instrument": instrument})


def rank_result(rank, wire, calls, final=None):
    """A rank's result with one passing check per checked step (3) and the given ledgers of
    every step (checked and timed)."""
    checks = [StepCheck(step=s, grad_max_abs=0.0, grad_ok=True, param_max_abs=0.0,
                        param_ok=True, names=["w"], loss=1.0, loss_abs=0.0, loss_ok=True)
              for s in range(3)]
    return RankResult(rank=rank, losses=[1.0] * 3, checks=checks, step_times=[0.1],
                      peak_bytes=None, model_states_per_step=[{}] * 3,
                      wire_by_axis_per_step=wire, calls_by_axis_per_step=calls, ledger=[],
                      timeline=[], final=final)


def merged(wire_per_step, calls_per_step=None, ranks=2, final=None):
    calls_per_step = calls_per_step or [{k: 1 for k, v in w.items() if v}
                                        for w in wire_per_step]
    return merge_ranks([rank_result(r, [dict(w) for w in wire_per_step],
                                    [dict(c) for c in calls_per_step],
                                    final if r == 1 else None) for r in range(ranks)], ["w"])


def test_steady_timed_steps_pass_against_the_closed_form():
    pred = Prediction.uniform(2, DP, calls={"dp": 1})
    t = timed_ledger(case(), merged([DP] * 6), pred)
    assert t.ok is True and t.reference == "the closed form" and t.failure is None


def test_a_timed_step_that_stops_reducing_fails_naming_step_rank_and_axis():
    pred = Prediction.uniform(2, DP, calls={"dp": 1})
    t = timed_ledger(case(), merged([DP] * 4 + [{}] * 2), pred)
    assert t.ok is False and (t.failure.step, t.failure.rank) == (4, 0)
    assert str(t.failure).startswith("step 4, rank 0: wire bytes on dp: 0 measured, "
                                     "1000 expected (the closed form")


def test_without_a_prediction_timed_steps_are_held_to_the_last_checked_step():
    """A baseline or a user's scheme without ``predict``: its own steady ledger."""
    assert timed_ledger(case(), merged([DP] * 6), None).ok is True
    t = timed_ledger(case(), merged([DP] * 3 + [{"dp": 999.0}] + [DP] * 2), None)
    assert t.ok is False and t.failure.step == 3
    assert "the last checked step's ledger" in str(t.failure)


def test_calls_are_held_too_when_the_bytes_agree():
    wire = [DP] * 6
    calls = [{"dp": 2}] * 3 + [{"dp": 2}, {"dp": 3}, {"dp": 2}]
    t = timed_ledger(case(), merged(wire, calls), None)
    assert t.ok is False and t.failure.what == "calls" and t.failure.step == 4


def test_a_by_step_prediction_holds_each_timed_step_to_its_own_figures():
    """Local SGD's period 2: sync on steps 1, 3, 5. The last checked step (2) moves nothing,
    so holding step 3 to it would be a false alarm; the closed form covers every step."""
    per_step = [{"dp": 0.0}, DP, {"dp": 0.0}, DP, {"dp": 0.0}, DP]
    pred = Prediction(wire_bytes_by_step=[[w, w] for w in per_step],
                      calls_by_step=[[{"dp": int(w["dp"] > 0)}] * 2 for w in per_step])
    ok = timed_ledger(case(), merged(per_step), pred)
    assert ok.ok is True and ok.reference.startswith("the closed form")
    skipped = per_step[:5] + [{"dp": 0.0}]
    bad = timed_ledger(case(), merged(skipped), pred)
    assert bad.ok is False and bad.failure.step == 5 and bad.failure.expected == 1000.0


def test_a_by_step_prediction_that_stops_early_is_not_repeated():
    """``Prediction.wire_at`` repeats its last entry past the list; a timed step the list does
    not reach is held to the last checked step instead (here: the same figures, so it passes,
    and a change still fails)."""
    pred = Prediction(wire_bytes_by_step=[[DP, DP]] * 3)
    assert timed_ledger(case(), merged([DP] * 6), pred).ok is True
    t = timed_ledger(case(), merged([DP] * 5 + [{}]), pred)
    assert t.ok is False and "the last checked step's ledger" in t.failure.detail


def test_a_baseline_off_its_closed_form_is_held_to_its_own_steady_step():
    pred = Prediction.uniform(2, {"dp": 500.0}, calls={"dp": 2})
    t = timed_ledger(case(), merged([DP] * 6), pred)
    assert t.ok is True and t.reference == "the last checked step's ledger"


@pytest.mark.parametrize("kw", [{"timed": 0}, {"instrument": "false"}])
def test_nothing_to_judge_is_none_not_a_pass(kw):
    steps = 3 + kw.get("timed", 3)
    assert timed_ledger(case(**kw), merged([DP] * steps), None).ok is None


def test_the_final_state_joins_equivalence_and_its_failure_is_named():
    bad = StepCheck(step=5, grad_max_abs=0.0, grad_ok=True, param_max_abs=1e-3,
                    param_ok=False, names=["w"])
    bad.failure = FirstFailure("final parameters", "w", 1e-3, 1e-4, "after the last timed step")
    m = merged([DP] * 6, final=bad)
    assert m.equivalent is False and m.golden_ok is False and m.final_ok is False
    assert str(m.first_failure).startswith("step 5, rank 1: final parameters 'w': "
                                           "max|ours - golden| = 0.001 > tolerance 0.0001")
    good = StepCheck(step=5, grad_max_abs=0.0, grad_ok=True, param_max_abs=1e-6,
                     param_ok=True, names=["w"])
    ok = merged([DP] * 6, final=good)
    assert ok.equivalent and ok.final_ok is True and ok.final_max_abs == 1e-6


def test_the_first_failure_is_the_earliest_checked_then_timed_then_final():
    checked = FirstFailure("gradient", "w", step=1, rank=0)
    timed = FirstFailure("wire bytes", "dp", step=4, rank=1, measured=0.0, expected=1.0)
    final = FirstFailure("final parameters", "w", step=5, rank=0)
    uncovered = FirstFailure("uncovered", "w")
    assert _earliest(checked, timed, 3) is checked
    assert _earliest(uncovered, timed, 3) is uncovered
    assert _earliest(final, timed, 3) is timed
    assert _earliest(final, None, 3) is final and _earliest(None, timed, 3) is timed
    assert _earliest(final, SimpleNamespace(step=5), 3).step == 5


def test_bytes_exact_covers_the_timed_steps_the_closed_form_states():
    """``Traffic.wire_exact``: a native scheme whose timed step leaves its closed form is not
    exact (what ``verify`` prints as its bytes); a list that stops at the checked steps is not
    stretched over the timed ones."""
    from parbench.verdict import traffic_of
    pred = Prediction.uniform(2, DP, calls={"dp": 1})
    assert traffic_of(case(), merged([DP] * 6), pred, []).wire_exact is True
    t = traffic_of(case(), merged([DP] * 5 + [{}]), pred, [])
    assert t.wire_exact is False and t.calls_exact is False
    short = Prediction(wire_bytes_by_step=[[DP, DP]] * 3)
    assert traffic_of(case(), merged([DP] * 5 + [{}]), short, []).wire_exact is True


def test_the_first_divergence_is_forward_first_then_backward_then_by_rank():
    """Across ranks: the earliest step; forward outputs (in the model's forward order) before
    input gradients (in backward order); then the lowest rank."""
    from parbench.probes import reference_order
    from parbench.results import Divergence
    from parbench.verdict.divergence import earliest
    order = reference_order(2)
    fwd_late = Divergence("forward output", "blocks.1.mlp", 0, 0)
    fwd_early = Divergence("forward output", "blocks.0.attn", 0, 1)
    bwd = Divergence("input gradient", "head", 0, 0)
    bwd_later = Divergence("input gradient", "blocks.0.ln1", 0, 0)
    assert earliest([fwd_late, fwd_early, bwd], order) is fwd_early
    assert earliest([None, bwd_later, bwd], order) is bwd
    assert earliest([Divergence("forward output", "embed", 1, 0), bwd], order) is bwd
    assert earliest([None, None], order) is None
    assert str(fwd_early) == "forward output of blocks.0.attn (rank 1, step 0)"
