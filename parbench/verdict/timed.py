"""The timed steps' ledgers (issue 20, section 1: every step whose figures are reported is
verified).

Step time, tokens/s, the ratio to a baseline and ``compare``'s time gate come from the timed
steps after the checked ones. Each timed step's ledger -- wire bytes and byte-carrying calls
per mesh axis, on every rank -- must equal a reference, so that the figures timed are those
of the computation that was checked:

- **the closed form** (``Prediction.wire_at(step)`` / ``calls_at(step)``), where it predicts
  that step (a ``*_by_step`` list covers it, or the figures are the same every step) and the
  checked steps equal it -- a scheme that follows its closed form must keep following it;
  schemes whose figures change from step to step (local SGD's sync steps, a continuous
  pipeline's drain, data-dependent MoE dispatch) are held to their own step's figures;
- otherwise **the last checked step's ledger**, rank by rank: a baseline (its bytes beside
  the closed form are a finding, not a rule), a user's scheme without ``predict``, or a
  scheme already off its closed form. A timed step that moves other bytes or makes other calls
  than the steady step it follows is a behaviour change.

Wire bytes agree to half a byte (they are sums of exact fractions of message sizes), calls
exactly. The first timed step that differs, on its lowest rank, is the row's failure
(``FirstFailure`` "wire bytes" / "calls"), unless a checked step failed before it.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..results import FirstFailure
from .verdict import exact_every_step, predicts_step

CLOSED_FORM = "the closed form"
LAST_CHECKED = "the last checked step's ledger"


@dataclass
class TimedLedger:
    """The timed steps' ledgers against their reference."""

    ok: bool | None
    reference: str = ""
    failure: FirstFailure | None = None


def _reference(kind: str, pred, merged, step: int) -> tuple[list[dict] | None, str]:
    """Per-rank reference figures of timed step ``step`` for ``kind`` (wire | calls)."""
    if kind == "wire":
        by_step, uniform, at = (pred.wire_bytes_by_step, pred.wire_bytes, pred.wire_at) \
            if pred else (None, None, None)
        checked, tol = merged.wire_by_step, 0.5
    else:
        by_step, uniform, at = (pred.calls_by_step, pred.calls, pred.calls_at) \
            if pred else (None, None, None)
        checked, tol = merged.calls_by_step, 0
    if pred is not None and predicts_step(by_step, uniform, step) and \
            exact_every_step(checked, at, tol) is True:
        return at(step), CLOSED_FORM
    return (checked[-1] if checked else None), LAST_CHECKED


def _first_difference(measured: list[dict], expected: list[dict], tol: float
                      ) -> tuple[int, str, float, float] | None:
    """(rank, axis, measured, expected) of the first rank and axis that differ."""
    for rank, (m, e) in enumerate(zip(measured, expected)):
        for axis in sorted(set(m) | set(e)):
            got, want = float(m.get(axis, 0) or 0), float(e.get(axis, 0) or 0)
            if abs(got - want) > tol:
                return rank, axis, got, want
    return None


def timed_ledger(case, merged, pred) -> TimedLedger:
    """Every timed step's ledger against its reference (module docstring); ``ok`` None when
    there are no timed steps or no traffic was recorded (``instrument=false``)."""
    steps = case.run.steps
    if not case.run.instrument or not merged.wire_timed or not merged.wire_by_step:
        return TimedLedger(ok=None)
    sources = set()
    for i, (wire, calls) in enumerate(zip(merged.wire_timed, merged.calls_timed)):
        step = steps + i
        if any(w is None for w in wire):  # run without the instruments (instrument_ab)
            continue
        for kind, measured, tol, what in (("wire", wire, 0.5, "wire bytes"),
                                          ("calls", calls, 0, "calls")):
            expected, source = _reference(kind, pred, merged, step)
            if expected is None:
                continue
            sources.add(source)
            diff = _first_difference(measured, expected, tol)
            if diff is not None:
                rank, axis, got, want = diff
                fail = FirstFailure(what, axis, measured=got, expected=want,
                                    detail=f"{source}; the figures timed come from this step")
                return TimedLedger(ok=False, reference=source, failure=fail.at(step, rank))
    return TimedLedger(ok=True, reference=" and ".join(sorted(sources)))
