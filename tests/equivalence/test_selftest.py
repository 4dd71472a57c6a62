"""The verdict's power: injected bugs are caught by a check (not by a crash, not by a
validator), unmodified schemes are not flagged.

The ``ci`` profile runs a stratified sample of the catalogue on one seed: at least one mutant
of every scheme that has mutants (``parbench.mutation.ci_sample``), and one per kind of check
(``CI_SUBSET``). ``HYPOTHESIS_PROFILE=thorough`` runs the whole catalogue with five seeds of
controls, as ``parbench selftest`` does."""
from __future__ import annotations

import os

from parbench.mutation import ci_sample, run_selftest, stratum
from parbench.selftest import CI_SUBSET
from parbench.selftest.catalogue import load


def test_the_catalogue_is_large_and_covers_every_native_family():
    catalogue = load()
    assert len(catalogue) >= 24
    bases = {m.base for m in catalogue.values()}
    assert {"data.ddp", "zero.1", "zero.2", "zero.3", "data.local_sgd"} <= bases
    assert any(b.startswith("pipeline.") for b in bases)
    assert set(CI_SUBSET) <= set(catalogue)


def test_every_mutant_is_killed_by_a_check_and_no_control_fails(pools):
    thorough = os.environ.get("HYPOTHESIS_PROFILE") == "thorough"
    catalogue = load()
    # on the session's ranks (the pools fixture's), started once per test session
    result = run_selftest("full" if thorough else "ci", seeds=5 if thorough else 1,
                          share_pools=True)
    expected = set(catalogue) if thorough else set(ci_sample(catalogue))
    assert {c["id"] for c in result["cases"]} == expected
    # every scheme that has mutants is sampled, the second wave's included (a framework's
    # baselines: one of them, ``mutation.stratum``)
    if thorough:
        assert set(result["schemes"]) == {m.base for m in catalogue.values()}
    assert {stratum(b) for b in result["schemes"]} == {stratum(m.base)
                                                       for m in catalogue.values()}
    # a mutant of a framework not installed here is skipped, with its reason, not run
    not_by_a_check = {c["id"]: (c["outcome"], c["caught_by"], c["failure"])
                      for c in result["cases"] if c["outcome"] not in ("check", "skipped")}
    assert not not_by_a_check, not_by_a_check
    assert all(c["skipped_because"] for c in result["cases"] if c["outcome"] == "skipped")
    assert result["killed_by_check"] == result["mutants"] - result["skipped"]
    assert result["false_alarms"] == 0, result["false_alarm_cases"]
    by_id = {c["id"]: c for c in result["cases"]}
    # the weight-decay bugs are caught by the update check, not by luck of the tolerances
    for c in result["cases"]:
        if c["id"].endswith(("-no-wd", "-double-wd")):
            assert "update" in c["caught_by"], c
    # bf16 rows (issue 20, sec. 4): the two gradient bugs are caught by the golden check at
    # tolerances derived from the step's rounding noise although every gradient's error is
    # below the stated bf16 atol of before (1e-2), which let them pass
    for i in ("zero2-bf16-one-grad-summed", "hybrid-bf16-sp-ln-not-reduced"):
        assert "golden" in by_id[i]["caught_by"], by_id[i]
        assert by_id[i]["max_grad_abs"] < 1e-2, by_id[i]
        assert by_id[i]["detectable_grad_error"] is not None
    assert "update" in by_id["zero1-bf16-no-wd"]["caught_by"]
    # clipping (issue 20, sec. 3): each family's wrong norm is caught by the gradient check,
    # on a case where the clip acted on every checked step (else it would test nothing)
    for i in ("zero2-clip-local-norm", "tp-clip-replicated-counted-twice",
              "1f1b-clip-tied-counted-twice", "cp-clip-before-grad-allreduce",
              "ep-clip-expert-norm-local", "hybrid-clip-tp-duplicates"):
        assert "golden" in by_id[i]["caught_by"], by_id[i]
        assert by_id[i]["clipped_steps"] and by_id[i]["clip_coef_min"] < 1.0, by_id[i]
    # a masked loss averaged per micro-batch: the loss itself differs from the golden run's
    assert "golden" in by_id["ddp-loss-mean-per-microbatch"]["caught_by"]
    # uneven pipeline stages (issue 21): a layer no rank built fails the row as uncovered
    # (a check, not a crash of the stepwise reference); swapped end ranks train every layer
    # once, so only the model states per rank show it
    uneven = by_id["interleaved-uneven-offset-one-rank-short"]
    assert uneven["caught_by"].startswith("golden") and "uncovered" in uneven["first_failure"]
    if "ring-gqa-kv-expanded" in by_id:  # K/V repeated before the ring: bytes only
        assert by_id["ring-gqa-kv-expanded"]["caught_by"] == "wire"
    if "1f1b-uneven-ends-swapped" in by_id:
        assert by_id["1f1b-uneven-ends-swapped"]["caught_by"] == "model_state"
    # bugs that leave the numbers alone are caught by the closed forms alone
    assert by_id["ddp-debug-allreduce"]["caught_by"] == "wire+calls"
    assert by_id["zero3-keeps-gathered-units"]["caught_by"] == "model_state"
