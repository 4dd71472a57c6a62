"""The verdict of a case: the merged checks, and every rank's measured bytes, calls and model
states against the closed forms (``Verdict``, ``Traffic``, ``ModelStates`` of the row).

A native scheme whose bytes or model states leave its closed form fails its case
(``Row.passed``); for a baseline the difference is a finding. Traffic is judged only where it
was recorded (``instrument=true``). The timed steps' ledgers (``verdict.timed``) and the final
parameters (``verdict.final``) are part of equivalence for every scheme, baselines included.
"""
from __future__ import annotations

from ..config import CaseConfig
from ..results import ModelStates, OpTally, Tolerance, Traffic, Verdict
from . import precision
from .checks import detectable_wd_error, golden_detectable_wd_error
from .merge import Merged


def exact_every_step(measured_by_step: list[list[dict]], predicted_at, tol: float = 0.0
                     ) -> bool | None:
    """``figures_equal`` on every step of ``measured_by_step`` (step s at index s;
    ``predicted_at(step)`` -> per-rank figures); None when nothing is predicted."""
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


def verdict_of(case: CaseConfig, scheme_cls, merged: Merged, golden, timed=None) -> Verdict:
    """The row's verdict: equivalence (the checked steps, the final state and, with
    ``timed`` -- ``verdict.timed.timed_ledger``'s -- the timed steps' ledgers), errors,
    tolerances, the first failure, and the smallest weight-decay error the comparison sees."""
    run = case.run
    checks_update = scheme_cls.checks_update
    timed_ok = timed.ok if timed is not None else None
    return Verdict(
        equivalent=merged.equivalent and timed_ok is not False, golden_ok=merged.golden_ok,
        update_ok=merged.update_ok if checks_update else None,
        max_loss_abs=merged.max_loss_abs, max_grad_abs=merged.max_grad_abs,
        max_param_abs=merged.max_param_abs, max_update_excess=merged.max_update_excess,
        tolerance=Tolerance(rtol=run.rtol, atol=run.atol, param_atol=run.param_atol,
                            derived=precision.RULE if merged.detectable_grad_error is not None
                            else ""),
        detectable_grad_error=merged.detectable_grad_error,
        clip_coef_min=merged.clip_coef_min, clipped_steps=merged.clipped_steps,
        first_failure=_earliest(merged.first_failure, timed.failure if timed else None,
                                run.steps),
        uncovered=merged.uncovered,
        detectable_wd_error=detectable_wd_error(run) if checks_update
        else golden_detectable_wd_error(run),
        losses=merged.losses, golden_losses=list(golden.losses),
        golden_source=getattr(golden, "source", "live"),
        timed_ok=timed_ok, timed_reference=timed.reference if timed else "",
        final_ok=merged.final_ok, final_max_abs=merged.final_max_abs,
        final_param_tol=merged.final_param_tol,
        known_finding=None if merged.equivalent and timed_ok is not False
        else getattr(scheme_cls, "known_finding", None))


def _earliest(checked, timed, steps: int):
    """The first failure of the row: a checked step's (or an uncovered parameter) first, then
    the earlier of a timed step's ledger and the final parameters (the ledger on a tie: the
    cause before its effect)."""
    if timed is None:
        return checked
    if checked is None:
        return timed
    if checked.step is None or checked.step < steps:
        return checked
    return timed if timed.step <= checked.step else checked


def predicts_step(by_step, uniform, step: int) -> bool:
    """Does a prediction state its figures for ``step``? A ``*_by_step`` list must reach it
    (``Prediction._at`` would repeat its last entry past the end); uniform figures hold for
    every step."""
    return step < len(by_step) if by_step is not None else uniform is not None


def _predicted_steps(checked: list, timed: list, by_step, uniform) -> list:
    """The checked steps' figures and those of the timed steps the prediction states."""
    n = sum(1 for i in range(len(timed)) if predicts_step(by_step, uniform, len(checked) + i))
    return checked + timed[:n]


def traffic_of(case: CaseConfig, merged: Merged, pred, records: list[dict]) -> Traffic:
    """Wire bytes and calls of the last checked step beside the closed form's (``pred``: the
    scheme's ``Prediction``, or None), exact on every step the closed form states (checked,
    and timed: issue 20) or not; ``records``: rank 0's ledger of the last checked step."""
    last = case.run.steps - 1
    judged = pred if pred is not None and case.run.instrument else None
    wire = calls = _nothing
    wire_steps, calls_steps = merged.wire_by_step, merged.calls_by_step
    if judged is not None:
        wire, calls = judged.wire_at, judged.calls_at
        wire_steps = _predicted_steps(wire_steps, merged.wire_timed,
                                      judged.wire_bytes_by_step, judged.wire_bytes)
        calls_steps = _predicted_steps(calls_steps, merged.calls_timed,
                                       judged.calls_by_step, judged.calls)
    return Traffic(
        wire=merged.wire_by_axis, calls=merged.calls_by_step[-1],
        wire_predicted=pred.wire_at(last) if pred else None,
        calls_predicted=pred.calls_at(last) if pred else None,
        wire_exact=exact_every_step(wire_steps, wire, tol=0.5),
        calls_exact=exact_every_step(calls_steps, calls), ops=op_tallies(records))


def states_of(merged: Merged, pred) -> ModelStates:
    """Model states per rank, measured beside the closed form, exact on every checked step.
    What a scheme keeps only for the checks (``checks``: ``memory.KeptForChecks``) is shown,
    and no closed form predicts it: it is left out of the comparison."""
    compared = [[{k: v for k, v in (s or {}).items() if k != "checks"} if s is not None
                 else None for s in step] for step in merged.states_by_step]
    return ModelStates(
        measured=merged.model_state_bytes,
        predicted=pred.model_state_bytes if pred else None,
        exact=exact_every_step(compared, pred.states_at if pred else _nothing),
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
