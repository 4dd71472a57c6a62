"""The final state: the parameters after the last timed step, against the golden rule
(issue 20, section 1: "every step whose figures are reported is verified").

The timed steps after the checked ones are not checked one by one: a per-step check would
need each step's gradients, which some baselines keep only in checked steps (DeepSpeed frees
them), and would put collectives between the timed steps. Instead, after the last timed step,
each rank compares the parameters it holds (``full_params``) with the golden rule carried
over every timed step:

- **Schemes that pass the update check** (``checks_update``): the *shadow continuation*. The
  update check's shadow ends the checked steps holding the scheme's own parameters after the
  last checked step and the optimizer state built from the gradients the scheme reported
  (exact to a few ulps when the checked steps passed). From there the golden rule trains on:
  for each timed step, the gradients of the golden model at the shadow's weights on that
  step's global batch, then one step of the run's optimizer. The scheme's final parameters
  must equal the shadow's to ``atol = param_atol`` (tensor-wise, ``rtol`` on the tensor's
  largest value, as every check). Starting from the scheme's own state, the shadow drifts
  from a correct scheme only over the timed steps, by AdamW's amplification of reduction-order
  noise (``RunConfig``: a fraction of lr per step at most; measured at most 2e-6 over two
  timed steps on the small case of every scheme), while a step that drops or changes a
  gradient's reduction moves parameters by up to lr = 1e-3 per step. Chosen over training
  the golden run ``steps + timed_steps`` steps from step 0 because that trajectory's drift
  grows over every step (docs/verdict.md, drift).
  The golden work runs after the timed steps: it never lands inside a timed step.
- **Schemes with their own update rule** (local SGD, PipeDream, 2BW): their golden run
  (``Scheme.reference``) simulated over ``steps + timed_steps`` steps; the final parameters
  held to ``param_atol``, as their checked steps are.

In a lower compute dtype the continuation runs twice from the same state, in that dtype and
in fp32, and each parameter is held to the tolerance derived from their difference
(``precision.final_tolerances``) instead of ``param_atol``: bf16 noise carried by AdamW grows
with the number of timed steps, so no stated bound fits every run length.

Cost: ``timed_steps`` forward-backward passes of the single-device golden model (or one
reference run) per rank, plus gathering the shadow when a rank holds part of the model.
"""
from __future__ import annotations

import torch

from .. import comm
from ..results import FirstFailure, StepCheck
from .checks import compare, completed
from .once import on_rank0
from .precision import final_tolerances

#: why a final check fails, in the row's first failure
DETAIL_CONTINUED = ("after the last timed step, against the golden rule continued over the "
                    "timed steps from the last checked step")
DETAIL_REFERENCE = "after the last timed step, against the golden run over every step"


def _shadow_state(update) -> dict[str, tuple[torch.Tensor, dict]]:
    """This rank's shadow: name -> (weights, optimizer state), on the CPU."""
    out = {}
    for n, p in update.shadow.items():
        state = {k: v.detach().cpu().clone() if torch.is_tensor(v) else v
                 for k, v in update.opt.state.get(p, {}).items()}
        out[n] = (p.detach().cpu().clone(), state)
    return out


def continue_shadow(update, stepwise, case, first: int, last: int, batch, low: bool = False,
                    model_state: dict | None = None) -> dict[str, torch.Tensor] | None:
    """The shadow carried from step ``first`` to step ``last`` (exclusive) by the golden rule:
    each step, the golden model's gradients at the shadow's weights and ``model_state`` (the
    routers' balancing biases, updated by each step) on ``batch(case, step)`` (the global
    batch; in the compute dtype with ``low``), then the optimizer; the weights and the final
    state. None when no rank holds some parameter (the row already fails as
    ``uncovered``)."""
    with comm.unrecorded():
        state = completed(_shadow_state(update), stepwise.params, lambda mine: mine)
    if set(stepwise.params) - set(state):
        return None
    # the golden work once, on rank 0 (``once``): the whole shadow is alike on every rank
    return on_rank0(lambda: _both(state, stepwise, case, first, last, batch, low, model_state),
                    case.run.shared_reference)


def _both(state: dict, stepwise, case, first: int, last: int, batch, low: bool,
          model_state: dict | None) -> dict[str, torch.Tensor] | tuple[dict, dict]:
    """The continuation; with ``low``, (in the compute dtype, in fp32) from the same state:
    their difference is one draw of the timed steps' rounding noise (``precision``)."""
    cont = _continued(state, stepwise, case, first, last, batch, low, model_state)
    if not low:
        return cont
    return cont, _continued(state, stepwise, case, first, last, batch, False, model_state)


def _continued(state: dict, stepwise, case, first: int, last: int, batch, low: bool,
               model_state: dict | None) -> dict[str, torch.Tensor]:
    """:func:`continue_shadow`'s steps from the whole shadow ``state`` (name -> (weights,
    optimizer state))."""
    from ..model import make_optimizer
    weights = {n: w.clone() for n, (w, _) in state.items()}
    opt = make_optimizer(list(weights.values()), case.run)
    for n, (_, st) in state.items():
        if st:
            opt.state[weights[n]] = {k: v.clone() if torch.is_tensor(v) else v
                                     for k, v in st.items()}
    for step in range(first, last):
        x, y = batch(case, step)
        _, grads = stepwise.at(weights, x, y, low, model_state)
        model_state = stepwise.state
        for n, w in weights.items():
            w.grad = grads[n].to(w.dtype)
        opt.step()
        for w in weights.values():
            w.grad = None
    return {**weights, **(model_state or {})}


def final_check(checker, case, total: int, batch) -> StepCheck | None:
    """This rank's final parameters (after step ``total - 1``) against the golden rule over
    every step (module docstring); a ``StepCheck`` of step ``total - 1`` whose ``param_*``
    fields hold the comparison and whose failure, if any, is ``final parameters``.
    ``batch(case, step)``: the global batch of a step (``golden.global_batch``, handed in:
    the golden package imports this one)."""
    run = case.run
    with comm.unrecorded():
        params = {**checker.scheme.full_params(), **checker.scheme.full_state()}
        if checker.update is not None:
            # in the compute dtype: a bf16 scheme continued by the bf16 golden rule
            expected = continue_shadow(checker.update, checker.stepwise, case, run.steps, total,
                                       batch, low=checker.stepwise.low is not None,
                                       model_state=checker.state)
            detail = DETAIL_CONTINUED
        else:
            ref = on_rank0(lambda: type(checker.scheme).reference(case, total),
                           run.shared_reference)
            expected, detail = ref.params[total - 1], DETAIL_REFERENCE
            expected = {**expected, **(ref.states[total - 1] if ref.states else {})}
    if expected is None:
        return None
    tols = None
    if isinstance(expected, tuple):
        expected, high = expected
        tols = final_tolerances(expected, high, checker.stepwise.dtype, total - run.steps)
    p = compare(params, expected, run.rtol, run.param_atol, tols)
    out = StepCheck(step=total - 1, grad_max_abs=0.0, grad_ok=True, param_max_abs=p["max_abs"],
                    param_ok=p["ok"], names=p["names"], missing=p["missing"],
                    param_tol=max(tols.values()) if tols else None)
    if p["worst"]:
        out.failure = FirstFailure("final parameters", detail=detail, **p["worst"])
    elif p["missing"]:
        out.failure = FirstFailure("final parameters", p["missing"][0],
                                   detail="reported by the scheme, absent from the golden run")
    return out


