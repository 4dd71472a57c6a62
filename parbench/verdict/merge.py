"""The ranks of one case merged: equivalence over every rank and step, and the measured
figures side by side (``Merged``)."""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from ..results import FirstFailure, RankResult


@dataclass
class Merged:
    """The ranks of one case, merged: equivalence and the measured figures."""

    #: golden_ok (losses, gradients, parameters within tolerance of the golden run, every
    #: parameter covered) and update_ok (the update check on every rank and step)
    equivalent: bool
    golden_ok: bool
    update_ok: bool
    max_loss_abs: float
    max_grad_abs: float
    max_param_abs: float
    #: the update check's largest error in units of its tolerance (None: not checked)
    max_update_excess: float | None
    uncovered: list[str]
    losses: list
    step_time_s: float | None
    #: the earliest failing check (with its step and rank), or None
    first_failure: FirstFailure | None
    peak_bytes: list
    model_state_bytes: list
    #: per rank, wire bytes per axis of the last checked step
    wire_by_axis: list[dict[str, float]]
    #: per checked step, per rank
    wire_by_step: list[list[dict[str, float]]] = field(default_factory=list)
    calls_by_step: list[list[dict[str, int]]] = field(default_factory=list)
    states_by_step: list[list[dict[str, int]]] = field(default_factory=list)
    #: per timed step (``steps``, ``steps + 1``, ...), per rank
    wire_timed: list[list[dict[str, float]]] = field(default_factory=list)
    calls_timed: list[list[dict[str, int]]] = field(default_factory=list)
    #: the final parameters after the last timed step (``verdict.final``; None: no timed
    #: steps): within param_atol of the golden rule on every rank, and the largest difference
    final_ok: bool | None = None
    final_max_abs: float | None = None
    #: a lower compute dtype: the final check's largest derived tolerance over the ranks
    #: (``verdict.precision.final_tolerances``); None: the stated param_atol
    final_param_tol: float | None = None
    #: a lower compute dtype's derived tolerances: the largest relative one over every rank
    #: and checked step (``verdict.precision``); None: fp32
    detectable_grad_error: float | None = None
    #: with gradient clipping: the smallest clip factor over the checked steps (1: the clip
    #: never acted, so the row says nothing about it) and the number of steps it acted on
    clip_coef_min: float | None = None
    clipped_steps: int | None = None

    @property
    def wire_measured(self) -> dict[str, float]:
        """Largest rank's bytes per axis (last checked step)."""
        axes = sorted({a for w in self.wire_by_axis for a in w})
        return {a: max(w.get(a, 0.0) for w in self.wire_by_axis) for a in axes}


@dataclass
class _Tally:
    """The checks of every rank and step, folded."""

    loss_abs: float = 0.0
    grad_abs: float = 0.0
    param_abs: float = 0.0
    update: float = 0.0
    ok: bool = True
    update_ok: bool = True
    checked_update: bool = False
    covered: set = field(default_factory=set)
    losses: list = field(default_factory=list)
    first: FirstFailure | None = None
    detectable: float | None = None
    clip_coefs: dict = field(default_factory=dict)

    def add(self, c, rank: int, step: int) -> None:
        if c.clip_coef is not None:
            self.clip_coefs[step] = c.clip_coef
        if c.detectable_grad_error is not None:
            self.detectable = max(self.detectable or 0.0, c.detectable_grad_error)
        if self.first is None and c.failure is not None:
            self.first = c.failure.at(step, rank)
        self.grad_abs = max(self.grad_abs, c.grad_max_abs)
        self.param_abs = max(self.param_abs, c.param_max_abs)
        self.ok = self.ok and c.grad_ok and c.param_ok and not c.missing \
            and c.init_ok is not False and c.state_ok is not False
        self.update_ok = self.update_ok and c.update_ok is not False
        self.checked_update = self.checked_update or c.update_ok is not None
        self.update = max(self.update, c.update_excess or 0.0)
        self.covered |= set(c.names)
        if c.loss_abs is not None:
            self.loss_abs = max(self.loss_abs, c.loss_abs)
            self.ok = self.ok and bool(c.loss_ok)


def merge_ranks(per_rank: list[RankResult], golden_names: list[str] | None = None) -> Merged:
    """Combine the per-rank results of one case. Equivalent means: every checked step's loss
    (on the ranks that hold it), gradients and parameters within tolerance on every rank,
    every golden parameter covered by some rank, and the final parameters after the last
    timed step within tolerance of the golden rule (``verdict.final``). The timed steps'
    ledgers are judged with the closed form (``verdict.timed``)."""
    steps = len(per_rank[0].checks)
    t = _Tally()
    for s in range(steps):
        step_loss = None
        for r in per_rank:
            c = r.checks[s]
            t.add(c, r.rank, s)
            if c.loss_abs is not None:
                step_loss = c.loss
        if step_loss is None:
            t.ok = False  # no rank reported the loss
        t.losses.append(step_loss)
    uncovered = sorted(set(golden_names or []) - t.covered)
    if uncovered:
        # the root cause of whatever else failed: part of the model is on no rank
        t.ok = False
        t.first = FirstFailure(
            "uncovered", uncovered[0],
            detail=f"{len(uncovered)} golden parameter(s) reported by no rank")
    final_ok, final_abs = _final(per_rank, t)
    tols = [r.final.param_tol for r in per_rank
            if r.final is not None and r.final.param_tol is not None]
    times = [statistics.median(r.step_times) for r in per_rank if r.step_times]
    return Merged(
        equivalent=t.ok and t.update_ok, golden_ok=t.ok, update_ok=t.update_ok,
        max_loss_abs=t.loss_abs, max_grad_abs=t.grad_abs, max_param_abs=t.param_abs,
        max_update_excess=t.update if t.checked_update else None,
        uncovered=uncovered, losses=t.losses, step_time_s=max(times) if times else None,
        first_failure=t.first,
        peak_bytes=[r.peak_bytes for r in per_rank],
        model_state_bytes=[r.model_state_bytes for r in per_rank],
        wire_by_axis=[r.wire_by_axis_per_step[steps - 1] for r in per_rank],
        wire_by_step=[[r.wire_by_axis_per_step[s] for r in per_rank] for s in range(steps)],
        calls_by_step=[[r.calls_by_axis_per_step[s] for r in per_rank] for s in range(steps)],
        states_by_step=[[r.model_states_per_step[s] for r in per_rank] for s in range(steps)],
        wire_timed=[[r.wire_by_axis_per_step[s] for r in per_rank]
                    for s in range(steps, len(per_rank[0].wire_by_axis_per_step))],
        calls_timed=[[r.calls_by_axis_per_step[s] for r in per_rank]
                     for s in range(steps, len(per_rank[0].calls_by_axis_per_step))],
        final_ok=final_ok, final_max_abs=final_abs, final_param_tol=max(tols, default=None),
        detectable_grad_error=t.detectable,
        clip_coef_min=min(t.clip_coefs.values()) if t.clip_coefs else None,
        clipped_steps=sum(c < 1.0 for c in t.clip_coefs.values()) if t.clip_coefs else None)


def _final(per_rank: list[RankResult], t: _Tally) -> tuple[bool | None, float | None]:
    """The final-state checks of every rank folded into ``t`` (their failure after any of
    the checked steps'): (all within tolerance, largest difference); (None, None) without."""
    finals = [(r.rank, r.final) for r in per_rank if r.final is not None]
    if not finals:
        return None, None
    ok = all(f.param_ok and not f.missing for _, f in finals)
    t.ok = t.ok and ok
    if t.first is None:
        rank, f = next(((r, f) for r, f in finals if f.failure is not None), (None, None))
        if f is not None:
            t.first = f.failure.at(f.step, rank)
    return ok, max(f.param_max_abs for _, f in finals)
