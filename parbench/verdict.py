"""The verdict: tensors compared, ranks merged, measured figures against predicted ones.

The per-rank checks of a step (golden, stepwise golden, update check) are in ``checks``.

Every comparison is tensor-wise: ``max|ours - golden| <= atol + rtol * max|golden|``. fp32
reduction-order noise scales with the magnitude of the summed terms, i.e. with the tensor's
scale rather than each element's (an element where terms cancel to ~0 carries the noise of
its large addends), so an elementwise rtol would reject correct runs.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import torch

from .results import RankResult


def compare(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], rtol: float,
            atol: float) -> dict:
    """Max |difference| and pass/fail over the names in ``ours``; ``worst``: the failing
    tensor furthest outside its tolerance (name, max_abs, tolerance), or None."""
    max_abs, ok, missing = 0.0, True, []
    worst, worst_ratio = None, 0.0
    for name, t in ours.items():
        if name not in ref:
            missing.append(name)
            ok = False
            continue
        a = t.detach().to(torch.float64).cpu()
        b = ref[name].detach().to(torch.float64).cpu()
        if a.shape != b.shape:
            raise ValueError(f"{name}: shape {tuple(a.shape)} != golden {tuple(b.shape)}")
        if not a.numel():
            continue
        d = float((a - b).abs().max())
        max_abs = max(max_abs, d)
        tol = atol + rtol * float(b.abs().max())
        if not d <= tol:
            ok = False
            ratio = d / tol if tol > 0 else float("inf")
            if worst is None or ratio > worst_ratio:
                worst, worst_ratio = {"tensor": name, "max_abs": d, "tolerance": tol}, ratio
    return {"max_abs": max_abs, "ok": ok, "missing": missing, "names": sorted(ours),
            "worst": worst}


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
    #: the earliest failing check (step, rank, what, tensor, max_abs, tolerance), or None
    first_failure: dict | None
    peak_bytes: list
    model_state_bytes: list
    #: per rank, wire bytes per axis of the last checked step
    wire_by_axis: list[dict[str, float]]
    #: per checked step, per rank
    wire_by_step: list[list[dict[str, float]]] = field(default_factory=list)
    calls_by_step: list[list[dict[str, int]]] = field(default_factory=list)
    states_by_step: list[list[dict[str, int]]] = field(default_factory=list)

    @property
    def wire_measured(self) -> dict[str, float]:
        """Largest rank's bytes per axis (last checked step)."""
        axes = sorted({a for w in self.wire_by_axis for a in w})
        return {a: max(w.get(a, 0.0) for w in self.wire_by_axis) for a in axes}


def merge_ranks(per_rank: list[RankResult], golden_names: list[str] | None = None) -> Merged:
    """Combine the per-rank results of one case. Equivalent means: every step's loss (on the
    ranks that hold it), gradients and parameters within tolerance on every rank, and every
    golden parameter covered by some rank."""
    steps = len(per_rank[0].checks)
    loss_abs = grad_abs = param_abs = update = 0.0
    ok = update_ok = True
    covered: set[str] = set()
    losses = []
    first = None
    for s in range(steps):
        step_loss = None
        for r in per_rank:
            c = r.checks[s]
            if first is None and c.failure is not None:
                first = {"step": s, "rank": r.rank, **c.failure}
            grad_abs = max(grad_abs, c.grad_max_abs)
            param_abs = max(param_abs, c.param_max_abs)
            ok = ok and c.grad_ok and c.param_ok and not c.missing and c.init_ok is not False
            update_ok = update_ok and c.update_ok is not False
            update = max(update, c.update_excess or 0.0)
            covered |= set(c.names)
            if c.loss_abs is not None:
                loss_abs = max(loss_abs, c.loss_abs)
                ok = ok and bool(c.loss_ok)
                step_loss = c.loss
        if step_loss is None:
            ok = False  # no rank reported the loss
        losses.append(step_loss)
    uncovered = sorted(set(golden_names or []) - covered)
    if uncovered:
        ok = False
        first = first or {"what": "uncovered", "tensor": uncovered[0],
                          "detail": f"{len(uncovered)} golden parameter(s) reported by no rank"}
    times = [statistics.median(r.step_times) for r in per_rank if r.step_times]
    return Merged(
        equivalent=ok and update_ok, golden_ok=ok, update_ok=update_ok,
        max_loss_abs=loss_abs, max_grad_abs=grad_abs, max_param_abs=param_abs,
        max_update_excess=update if any(c.update_ok is not None for r in per_rank
                                        for c in r.checks) else None,
        uncovered=uncovered, losses=losses, step_time_s=max(times) if times else None,
        first_failure=first,
        peak_bytes=[r.peak_bytes for r in per_rank],
        model_state_bytes=[r.model_state_bytes for r in per_rank],
        wire_by_axis=[r.wire_by_axis_per_step[steps - 1] for r in per_rank],
        wire_by_step=[[r.wire_by_axis_per_step[s] for r in per_rank] for s in range(steps)],
        calls_by_step=[[r.calls_by_axis_per_step[s] for r in per_rank] for s in range(steps)],
        states_by_step=[[r.model_states_per_step[s] for r in per_rank] for s in range(steps)])


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
