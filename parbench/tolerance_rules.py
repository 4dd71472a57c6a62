"""Tolerances no comparison can fail, refused before anything runs (issue 20, sec. 8): the
bound on how far two AdamW runs from the same weights can move a parameter apart
(Kingma & Ba 2015, Sec. 2.1), and the rules ``validate_tolerances`` applies to a run's
``rtol`` and ``param_atol``."""
from __future__ import annotations

import math

from .layout import ConfigError


def adam_step_bound(t: int, beta1: float, beta2: float) -> float:
    """The largest |m_hat / sqrt(v_hat)| Adam's step ``t`` (1-based, bias-corrected, eps = 0)
    can take, over every gradient sequence: m_hat and v_hat are weighted means of g and g^2
    (weights w_i, u_i summing to 1), so by Cauchy-Schwarz |m_hat| <= sqrt(sum w_i^2 / u_i)
    sqrt(v_hat). It is 1 at t = 1 and tends to the steady bound of Kingma & Ba 2015, Sec. 2.1
    (about 1.17 for betas (0.9, 0.95))."""
    ratio = sum((beta1 * beta1 / beta2) ** k for k in range(t))
    return math.sqrt((1 - beta1) ** 2 * (1 - beta2 ** t) * ratio
                     / ((1 - beta1 ** t) ** 2 * (1 - beta2)))


def adamw_max_divergence(r) -> float:
    """The farthest two AdamW runs (``r``: a ``config.RunConfig``) from the same weights can
    move one parameter apart over the run's ``steps + timed_steps`` steps: each moves it by
    at most lr * bound(t) at step t (``adam_step_bound``), and AdamW's decoupled decay only
    shrinks the distance (both copies scale by 1 - lr * weight_decay). A ``param_atol`` at
    or above it cannot fail. Linear in the steps (a run of 10^5 timed steps is checked at
    once)."""
    n, b1, b2 = r.steps + r.timed_steps, r.beta1, r.beta2
    q, ratio, total = b1 * b1 / b2, 0.0, 0.0
    for t in range(1, n + 1):  # adam_step_bound(t) with its series carried from t - 1
        try:
            ratio += q ** (t - 1)
        except OverflowError:  # beta1^2 > beta2: Adam's step has no bound (Kingma & Ba's
            return math.inf    # beta1 < sqrt(beta2)), so no param_atol is above it
        total += math.sqrt((1 - b1) ** 2 * (1 - b2 ** t) * ratio
                           / ((1 - b1 ** t) ** 2 * (1 - b2)))
    return 2 * r.lr * total


def validate_tolerances(r) -> None:
    """Reject a tolerance no comparison can fail (issue 20, sec. 8): ``rtol >= 1`` lets a
    tensor of zeros (a dropped gradient) pass against any golden tensor (max|0 - g| <= rtol
    max|g|); under AdamW, ``param_atol >= adamw_max_divergence`` lets any parameters pass.
    SGD's step is lr (g + wd p), not bounded by lr alone, and ``atol`` is an absolute floor
    on tensors whose scale depends on the data: no rule is stated for them here."""
    if r.rtol >= 1:
        raise ConfigError(f"rtol={r.rtol:g} must be < 1: at rtol >= 1 a tensor of zeros "
                          "(a dropped gradient) is within tolerance of every golden tensor")
    if r.optimizer == "adamw":
        bound = adamw_max_divergence(r)
        if r.param_atol >= bound:
            n = r.steps + r.timed_steps
            raise ConfigError(
                f"param_atol={r.param_atol:g} cannot fail: two AdamW runs from the same "
                f"weights move a parameter apart by at most {bound:.4g} over steps + "
                f"timed_steps = {n} (2 * lr * |m_hat/sqrt(v_hat)| per step, Kingma & Ba "
                f"2015 Sec. 2.1); param_atol must be < {bound:.4g}")
