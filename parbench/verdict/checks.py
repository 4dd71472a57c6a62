"""The checks one rank makes after each checked step (merged by ``verdict.merge``).

Every comparison is tensor-wise (``compare``): ``max|ours - golden| <= atol + rtol *
max|golden|``. fp32 reduction-order noise scales with the magnitude of the summed terms, i.e.
with the tensor's scale rather than each element's (an element where terms cancel to ~0
carries the noise of its large addends), so an elementwise rtol would reject correct runs.

- the golden comparison: loss, gradients and parameters against the golden run;
- the stepwise golden (``StepwiseGolden``): loss and gradients against the golden model loaded
  with the scheme's own weights before the step, on identical weights, every step;
- the update check (``UpdateCheck``): the scheme's new parameters against the run's optimizer
  applied to the scheme's own weights and reported gradients;
- the initialisation: the scheme's parameters before step 0 equal the golden ones exactly;
- the model state beside the parameters (``Scheme.full_state``: the MoE routers' balancing
  biases, DeepSeek-V3 Sec. 2.1.2) after each step against the stepwise golden's: the golden
  model at the scheme's weights *and state* before the step updates its state from the
  step's global load, and the scheme's must equal it (rtol, atol); with the parameters, it
  is compared with the golden trajectory too.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import comm
from ..model.moe import reset_step_loads, update_expert_bias
from ..model.router import expert_bias_state, load_state
from ..model.training import clip_coefficient, clip_local_
from ..results import FirstFailure, StepCheck
from . import precision
from .once import on_rank0, pack, unpack


def compare(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], rtol: float,
            atol: float, tols: dict[str, float] | None = None) -> dict:
    """Max |difference| and pass/fail over the names in ``ours``; ``worst``: the failing
    tensor furthest outside its tolerance (name, max_abs, tolerance), or None. ``tols``: a
    tolerance per tensor (a bf16 row's, ``verdict.precision``) instead of rtol and atol."""
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
        tol = tols[name] if tols is not None else atol + rtol * float(b.abs().max())
        if not d <= tol:
            ok = False
            ratio = d / tol if tol > 0 else float("inf")
            if worst is None or ratio > worst_ratio:
                worst, worst_ratio = {"tensor": name, "max_abs": d, "tolerance": tol}, ratio
    return {"max_abs": max_abs, "ok": ok, "missing": missing, "names": sorted(ours),
            "worst": worst}


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
        from ..model import make_optimizer
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


@dataclass
class Reference:
    """The stepwise golden's loss and gradients for one step; with a lower compute dtype, the
    tolerances derived for it (``verdict.precision``): the loss's, each gradient's, and the
    largest relative one (the error fraction the step is sure to catch)."""

    loss: float
    grads: dict[str, torch.Tensor]
    loss_tol: float | None = None
    tols: dict[str, float] | None = None
    detectable: float | None = None
    #: with clipping: the global gradient norm before clipping (``grads`` are clipped)
    grad_norm: float | None = None
    #: the model state after the step (the routers' balancing biases; empty without them)
    state: dict | None = None


class StepwiseGolden:
    """The golden model at the scheme's own weights ("teacher forcing"): before checked step
    t the scheme holds parameters p_t; the single-device reference model loaded with p_t gives
    the loss and gradients the step must produce, on identical weights, so every step's
    gradients are held to the tight tolerance of step 0 (rtol, atol), with no drift. With the
    update check (p_(t+1) = optimizer(p_t, g_t) to a few ulps) and p_0 equal to the golden
    initialisation exactly, the whole trajectory is verified step by step; the comparison with
    the golden trajectory itself remains, reported as drift.
    """

    def __init__(self, case, routing):
        """``routing``: the MoE routing groups of the scheme (``Scheme.routing_groups``).
        A run in a lower compute dtype also keeps the reference in that dtype (``low``), whose
        difference from the fp32 one sets the step's tolerances (``verdict.precision``)."""
        from ..model import build_model, compute_dtype
        self.model = build_model(case.model, case.run.seed,
                                 routing if case.model.num_experts else None)
        #: the run's clipping (``clip_grad``): ``at`` returns the clipped gradients, what the
        #: optimizer steps on and a scheme reports; ``norm`` is the last global norm before
        #: clipping (fp32 reference)
        self.clip_grad, self.norm = case.run.clip_grad, None
        #: the model state the last ``at`` left (``at``)
        self.state: dict[str, torch.Tensor] = {}
        self.params = dict(self.model.named_parameters())
        self.dtype = compute_dtype(case.run)
        self.low = None
        if self.dtype != torch.float32:
            self.low = copy.deepcopy(self.model).to(self.dtype)

    @property
    def initial(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.params.items()}

    def at(self, weights: dict[str, torch.Tensor], inputs, targets, low: bool = False,
           state: dict[str, torch.Tensor] | None = None
           ) -> tuple[float, dict[str, torch.Tensor]]:
        """(loss, gradients) of the reference model at ``weights`` and model ``state`` (the
        routers' balancing biases; None: as they are) on the global batch; in the compute
        dtype with ``low`` (gradients returned in fp32). ``self.state``: the state the step
        leaves (the biases updated from the step's load)."""
        model = self.low if low else self.model
        params = dict(model.named_parameters())
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(weights[n].detach().to(p.device, p.dtype))
        if state is not None:
            load_state(model, state)
        model.zero_grad(set_to_none=True)
        reset_step_loads(model)
        loss = model(inputs, targets)
        loss.backward()
        update_expert_bias(model)
        self.state = {n: b.detach().float().clone() for n, b in expert_bias_state(model).items()}
        grads = {n: p.grad.detach().float().clone() for n, p in params.items()}
        if self.clip_grad:
            self.norm = clip_local_(list(grads.values()), self.clip_grad)
        return float(loss.detach()), grads

    def reference(self, weights: dict[str, torch.Tensor], inputs, targets,
                  state: dict[str, torch.Tensor] | None = None) -> Reference:
        """What checked step must produce at ``weights`` and model ``state``, and its
        tolerances: the fp32 reference, and in a lower compute dtype the tolerances derived
        from the same step in that dtype (``verdict.precision``)."""
        loss, grads = self.at(weights, inputs, targets, state=state)
        norm, after = self.norm, self.state
        if self.low is None:
            return Reference(loss, grads, grad_norm=norm, state=after)
        low_loss, low_grads = self.at(weights, inputs, targets, low=True, state=state)
        tols = precision.tolerances(low_grads, grads, self.dtype)
        return Reference(loss, grads, precision.loss_tolerance(low_loss, loss, self.dtype),
                         tols, precision.relative(tols, grads), grad_norm=norm, state=after)


def check_step(scheme, golden, step: int, loss, run, update: UpdateCheck | None = None,
               reference: Reference | None = None) -> StepCheck:
    """This rank's tensors of checked step ``step``.

    With ``reference`` (the stepwise golden's loss and gradients at the scheme's weights
    before the step) the loss and gradients are held to (rtol, atol) at every step, and the
    parameters' distance from the golden trajectory is reported as drift; ``update`` checks
    the step itself. Without (schemes with another update rule, whose golden run simulates
    it): the golden trajectory -- step 0's gradients to (rtol, atol), later gradients and all
    parameters to param_atol, as AdamW amplifies fp32 noise in near-zero gradients.
    """
    grads = scheme.full_grads()
    state = scheme.full_state()
    params = {**scheme.full_params(), **state}
    golden_state = golden.states[step] if golden.states else {}
    p = compare(params, {**golden.params[step], **golden_state}, run.rtol, run.param_atol)
    if reference is not None:
        ref_loss = reference.loss
        g = compare(grads, reference.grads, run.rtol, run.atol, reference.tols)
    else:
        ref_loss = golden.losses[step]
        g = compare(grads, golden.grads[step], run.rtol,
                    run.atol if step == 0 else run.param_atol)
    out = StepCheck(step=step, grad_max_abs=g["max_abs"], grad_ok=g["ok"],
                    param_max_abs=p["max_abs"], param_ok=p["ok"] or reference is not None,
                    names=sorted(set(g["names"]) | set(p["names"])),
                    missing=g["missing"] + p["missing"], stepwise=reference is not None)
    if update is not None:
        out.update_excess, out.update_ok = update.check(grads, {n: params[n] for n in params
                                                               if n not in state})
    st = None
    if reference is not None and (state or reference.state):
        st = compare(state, reference.state, run.rtol, run.atol)
        out.state_max_abs, out.state_ok = st["max_abs"], st["ok"] and not st["missing"]
    if reference is not None and reference.grad_norm is not None:
        out.grad_norm = reference.grad_norm
        out.clip_coef = clip_coefficient(reference.grad_norm, run.clip_grad)
    loss_tol = run.atol + run.rtol * abs(ref_loss)
    if reference is not None and reference.tols is not None:
        loss_tol, out.detectable_grad_error = reference.loss_tol, reference.detectable
    if loss is not None:
        d = abs(float(loss) - ref_loss)
        out.loss, out.golden_loss, out.loss_abs = float(loss), golden.losses[step], d
        out.loss_ok = d <= loss_tol
    out.failure = _first_failure(out, g, p, loss_tol, st)
    return out


#: why a state check fails, in the row's first failure
DETAIL_STATE = ("the model state after the step (the routers' balancing bias) differs from "
                "the golden model's update at the scheme's weights and state")


def _first_failure(out: StepCheck, g: dict, p: dict, loss_tol: float,
                   st: dict | None = None) -> FirstFailure | None:
    """What failed first, in the order a reader debugs: loss, gradients, parameters, the
    model state, the update, tensors the golden run lacks."""
    if out.loss_ok is False:
        return FirstFailure("loss", "loss", out.loss_abs, loss_tol)
    if not out.grad_ok and g["worst"]:
        return FirstFailure("gradient", **g["worst"])
    if not out.param_ok and p["worst"]:
        return FirstFailure("parameter", **p["worst"])
    if out.state_ok is False:
        if st["worst"]:
            return FirstFailure("state", detail=DETAIL_STATE, **st["worst"])
        return FirstFailure("state", (st["missing"] or ["?"])[0], detail=DETAIL_STATE)
    if out.update_ok is False:
        return FirstFailure("update", "(optimizer step)", out.update_excess, 1.0,
                            "the step differs from the run's optimizer applied to the "
                            "reported gradients (max_abs in units of the update tolerance)")
    if out.missing:
        return FirstFailure("missing", out.missing[0],
                            detail="reported by the scheme, absent from the golden run")
    return None


def check_initial(params: dict[str, torch.Tensor], stepwise: StepwiseGolden) -> float:
    """Largest |p_0 - golden initialisation| over this rank's parameters (must be 0: every
    scheme builds its shard from the same seeded full weights)."""
    init = stepwise.initial
    worst = 0.0
    for n, t in params.items():
        if n not in init:
            return float("inf")
        worst = max(worst, float((t.detach().float().cpu() - init[n]).abs().max()))
    return worst


def completed(mine: dict, names, portable) -> dict:
    """``mine`` ({parameter name: value}) when every rank holds every name in ``names``; else
    the union of every rank's ``portable(mine)`` (all_gather_object, outside the ledger: a
    pipeline stage holds part of the model). Collective: every rank calls it."""
    complete = torch.tensor([int(set(mine) >= set(names))])
    dist.all_reduce(complete, op=dist.ReduceOp.MIN)
    if complete.item():
        return mine
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, pack(portable(mine)))
    full: dict = {}
    for part in parts:
        for n, v in unpack(part).items():
            full.setdefault(n, v)
    return full


class RankChecker:
    """Everything one rank checks, step after step, for one case."""

    def __init__(self, scheme, case, golden):
        self.scheme, self.run, self.golden = scheme, case.run, golden
        self.update = self.stepwise = None
        self.init_max_abs = None
        if type(scheme).checks_update:
            with comm.unrecorded():
                start = scheme.full_params()
            self.update = UpdateCheck(start, case.run)
            self.stepwise = StepwiseGolden(case, type(scheme).routing_groups(case))
            self.init_max_abs = check_initial(start, self.stepwise)
        #: the scheme's model state before the next step (``Scheme.full_state``)
        self.state = self._scheme_state()

    def _scheme_state(self) -> dict[str, torch.Tensor]:
        """The scheme's state, completed over the ranks when the stepwise reference needs
        the whole model's and a rank holds part of it (a pipeline stage's biases)."""
        with comm.unrecorded():
            mine = {n: t.detach().cpu().clone() for n, t in self.scheme.full_state().items()}
            names = expert_bias_state(self.stepwise.model) if self.stepwise else {}
            return completed(mine, names, lambda m: m) if names else mine

    def _full_weights(self) -> dict[str, torch.Tensor]:
        """The whole model's weights before this step (``completed``)."""
        return completed(self.update.shadow, self.stepwise.params,
                         lambda mine: {n: t.cpu() for n, t in mine.items()})

    def check(self, step: int, loss, inputs, targets) -> StepCheck:
        with comm.unrecorded():
            reference = None
            if self.stepwise is not None:
                weights = self._full_weights()
                # ranks whose parameters leave part of the model out (a layer no stage
                # built) have no weights to run the reference at: the golden trajectory
                # checks them, and the merge fails the row as ``uncovered``
                if set(weights) >= set(self.stepwise.params):
                    # computed once, on rank 0 (``once``): the whole model's weights are
                    # alike on every rank, a rank's own copy of them held to its update check
                    reference = on_rank0(lambda: self.stepwise.reference(
                        weights, inputs, targets, self.state), self.run.shared_reference)
            out = check_step(self.scheme, self.golden, step, loss, self.run, self.update,
                             reference)
        self.state = self._scheme_state()
        if step == 0 and self.init_max_abs is not None:
            out.init_max_abs = self.init_max_abs
            out.init_ok = self.init_max_abs == 0.0
            if not out.init_ok and out.failure is None:
                out.failure = FirstFailure("init", "(initial parameters)",
                                           self.init_max_abs, 0.0,
                                           "the parameters before step 0 differ from the "
                                           "golden initialisation")
        return out
