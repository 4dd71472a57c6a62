"""The verdict of a case: the merged checks, and every rank's measured bytes, calls and model
states against the closed forms (``Verdict``, ``Traffic``, ``ModelStates`` of the row).

A native scheme whose bytes or model states leave its closed form fails its case
(``Row.passed``); for a baseline the difference is a finding. Traffic is judged only where it
was recorded (``instrument=true``).
"""
from __future__ import annotations

from ..config import CaseConfig
from ..results import ModelStates, OpTally, Tolerance, Traffic, Verdict
from .checks import detectable_wd_error, golden_detectable_wd_error
from .merge import Merged


def exact_every_step(measured_by_step: list[list[dict]], predicted_at, tol: float = 0.0
                     ) -> bool | None:
    """``figures_equal`` on every checked step (``predicted_at(step)`` -> per-rank figures);
    None when nothing is predicted."""
    verdicts = [figures_equal(m, predicted_at(s), tol) for s, m in enumerate(measured_by_step)]
    if all(v is None for v in verdicts):
        return None
    return all(v is not False for v in verdicts)


def figures_equal(measured: list[dict], predicted: list[dict] | None,
                  tol: float = 0.0) -> bool | None:
    """Every rank's measured {key: value} equals its prediction (None: nothing predicted or
    nothing measured)."""
    if not predicted or any(m is None for m in measured):
        return None
    for m, p in zip(measured, predicted):
        for k in set(m) | set(p):
            if abs(float(m.get(k, 0) or 0) - float(p.get(k, 0) or 0)) > tol:
                return False
    return True


def _nothing(step: int):
    return None


def verdict_of(case: CaseConfig, scheme_cls, merged: Merged, golden) -> Verdict:
    """The row's verdict: equivalence, errors, tolerances, the first failure, and the
    smallest weight-decay error the comparison sees."""
    run = case.run
    checks_update = scheme_cls.checks_update
    return Verdict(
        equivalent=merged.equivalent, golden_ok=merged.golden_ok,
        update_ok=merged.update_ok if checks_update else None,
        max_loss_abs=merged.max_loss_abs, max_grad_abs=merged.max_grad_abs,
        max_param_abs=merged.max_param_abs, max_update_excess=merged.max_update_excess,
        tolerance=Tolerance(rtol=run.rtol, atol=run.atol, param_atol=run.param_atol),
        first_failure=merged.first_failure, uncovered=merged.uncovered,
        detectable_wd_error=detectable_wd_error(run) if checks_update
        else golden_detectable_wd_error(run),
        losses=merged.losses, golden_losses=list(golden.losses),
        golden_source=getattr(golden, "source", "live"))


def traffic_of(case: CaseConfig, merged: Merged, pred, records: list[dict]) -> Traffic:
    """Wire bytes and calls of the last checked step beside the closed form's (``pred``: the
    scheme's ``Prediction``, or None), exact on every checked step or not; ``records``: rank
    0's ledger of that step."""
    last = case.run.steps - 1
    judged = pred if pred is not None and case.run.instrument else None
    return Traffic(
        wire=merged.wire_by_axis, calls=merged.calls_by_step[-1],
        wire_predicted=pred.wire_at(last) if pred else None,
        calls_predicted=pred.calls_at(last) if pred else None,
        wire_exact=exact_every_step(merged.wire_by_step,
                                    judged.wire_at if judged else _nothing, tol=0.5),
        calls_exact=exact_every_step(merged.calls_by_step,
                                     judged.calls_at if judged else _nothing),
        ops=op_tallies(records))


def states_of(merged: Merged, pred) -> ModelStates:
    """Model states per rank, measured beside the closed form, exact on every checked step."""
    return ModelStates(
        measured=merged.model_state_bytes,
        predicted=pred.model_state_bytes if pred else None,
        exact=exact_every_step(merged.states_by_step, pred.states_at if pred else _nothing),
        paper=pred.paper_model_state_bytes if pred else None)


def op_tallies(records: list[dict]) -> list[OpTally]:
    """One rank's ledger records of a step, tallied per axis and op (in first-call order)."""
    out: dict[tuple[str, str], OpTally] = {}
    for r in records:
        e = out.setdefault((r["axis"], r["op"]), OpTally(axis=r["axis"], op=r["op"]))
        e.count += 1
        e.message_bytes += r["message_bytes"]
        e.wire_bytes += r["wire_bytes"]
    return list(out.values())
