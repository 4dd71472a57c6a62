"""The verdict: tensors against the golden run, ranks merged, measured bytes against predicted.

Every comparison is tensor-wise: ``max|ours - golden| <= atol + rtol * max|golden|``. fp32
reduction-order noise scales with the magnitude of the summed terms, i.e. with the tensor's
scale rather than each element's (an element where terms cancel to ~0 carries the noise of
its large addends), so an elementwise rtol would reject correct runs.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import torch

from .results import RankResult, StepCheck


def compare(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], rtol: float,
            atol: float) -> dict:
    """Max |difference| and pass/fail over the names in ``ours``."""
    max_abs, ok, missing = 0.0, True, []
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
        if not d <= atol + rtol * float(b.abs().max()):
            ok = False
    return {"max_abs": max_abs, "ok": ok, "missing": missing, "names": sorted(ours)}


#: the update check's tolerance, elementwise: |ours - expected| <= UPDATE_RTOL |expected| +
#: UPDATE_ATOL_LR * lr. The expected update is the same optimizer arithmetic applied to the
#: same fp32 tensors, so the only differences are a few ulps where vectorised and scalar
#: kernels round differently: 2^-20 is 8 ulps of fp32 relative, and lr * 2^-20 bounds an
#: update's rounding on parameters near zero.
UPDATE_RTOL = 2.0 ** -20
UPDATE_ATOL_LR = 2.0 ** -20


class UpdateCheck:
    """Did the scheme's optimizer step do what the run's optimizer does with the gradients the
    scheme reports? A shadow optimizer (``make_optimizer``, the same arithmetic) holds the
    scheme's own parameters of the previous step, is handed the scheme's reported gradients,
    steps, and its result is compared element by element with the scheme's new parameters.

    This separates the optimizer from the gradients: reduction-order noise in a gradient
    (held to the golden run's tolerance) cannot hide a bug in the update, whose tolerance is a
    few ulps. A weight-decay error of dw moves a parameter p by lr * dw * p per step, so the
    smallest error this check detects is about ``UPDATE_RTOL / lr`` (``detectable_wd_error``).
    """

    def __init__(self, params: dict[str, torch.Tensor], run):
        from .model import make_optimizer
        self.run = run
        self.shadow = {n: t.detach().float().clone() for n, t in params.items()}
        self.opt = make_optimizer(list(self.shadow.values()), run)

    def check(self, grads: dict[str, torch.Tensor], params: dict[str, torch.Tensor]
              ) -> tuple[float, bool]:
        """(largest |ours - expected| in units of the tolerance, ok); then the shadow takes
        the scheme's new parameters as its own."""
        names = [n for n in self.shadow if n in grads and n in params]
        if len(names) != len(self.shadow):
            return float("inf"), False
        for n in names:
            self.shadow[n].grad = grads[n].detach().float().to(self.shadow[n].device)
        self.opt.step()
        worst, ok = 0.0, True
        atol = UPDATE_ATOL_LR * self.run.lr
        for n in names:
            expected = self.shadow[n].detach()
            got = params[n].detach().float().to(expected.device)
            excess = ((got - expected).abs() / (atol + UPDATE_RTOL * expected.abs())).max()
            worst = max(worst, float(excess)) if expected.numel() else worst
            with torch.no_grad():
                self.shadow[n].copy_(got)
            self.shadow[n].grad = None
        ok = worst <= 1.0
        return worst, ok


def detectable_wd_error(run) -> float | None:
    """The smallest weight-decay error the update check sees in one step: a decay off by dw
    moves a parameter p by lr * dw * |p|, against a tolerance of UPDATE_RTOL |p| +
    UPDATE_ATOL_LR lr; on a parameter of magnitude 1 (LayerNorm weights start at 1) that is
    dw = UPDATE_RTOL / lr + UPDATE_ATOL_LR (about 1e-3 at lr 1e-3, a tenth of the default
    weight decay 0.01)."""
    if run.optimizer != "adamw":
        return None
    return UPDATE_RTOL / run.lr + UPDATE_ATOL_LR


def golden_detectable_wd_error(run) -> float:
    """Without the update check, a decay error dw shows only through the parameters against
    the golden run: after the checked steps it has moved a parameter of magnitude 1 by
    steps * lr * dw, against param_atol + rtol."""
    return (run.param_atol + run.rtol) / (run.lr * run.steps)


def check_step(scheme, golden, step: int, loss, run, update: UpdateCheck | None = None
               ) -> StepCheck:
    """This rank's tensors of checked step ``step`` against the golden run, and its update
    against the shadow optimizer (``update``; None for schemes with another update rule).

    Step 0 runs on identical weights: gradients must agree to fp32 reduction noise (atol).
    Later steps run on weights that already carry AdamW's amplified drift (param_atol), so
    their gradients are held to param_atol.
    """
    grads = scheme.full_grads()
    params = scheme.full_params()
    g = compare(grads, golden.grads[step], run.rtol, run.atol if step == 0 else run.param_atol)
    p = compare(params, golden.params[step], run.rtol, run.param_atol)
    out = StepCheck(step=step, grad_max_abs=g["max_abs"], grad_ok=g["ok"],
                    param_max_abs=p["max_abs"], param_ok=p["ok"],
                    names=sorted(set(g["names"]) | set(p["names"])),
                    missing=g["missing"] + p["missing"])
    if update is not None:
        out.update_excess, out.update_ok = update.check(grads, params)
    if loss is not None:
        ref = golden.losses[step]
        d = abs(float(loss) - ref)
        out.loss, out.golden_loss, out.loss_abs = float(loss), ref, d
        out.loss_ok = d <= run.atol + run.rtol * abs(ref)
    return out


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
    for s in range(steps):
        step_loss = None
        for r in per_rank:
            c = r.checks[s]
            grad_abs = max(grad_abs, c.grad_max_abs)
            param_abs = max(param_abs, c.param_max_abs)
            ok = ok and c.grad_ok and c.param_ok and not c.missing
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
    times = [statistics.median(r.step_times) for r in per_rank if r.step_times]
    return Merged(
        equivalent=ok and update_ok, golden_ok=ok, update_ok=update_ok,
        max_loss_abs=loss_abs, max_grad_abs=grad_abs, max_param_abs=param_abs,
        max_update_excess=update if any(c.update_ok is not None for r in per_rank
                                        for c in r.checks) else None,
        uncovered=uncovered, losses=losses, step_time_s=max(times) if times else None,
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
