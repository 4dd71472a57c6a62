"""A tolerance no comparison can fail is bad input (issue 20, sec. 8): one line before any
rank is spawned, naming the field, the value and the rule. The AdamW bound the rule rests on
is checked against torch's AdamW itself: no pair of gradient sequences moves two copies of a
parameter farther apart than it, and opposite constant gradients come within 1% of it (so the
rule rejects only tolerances that are vacuous, not merely loose)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from parbench.tolerance_rules import adamw_max_divergence
from parbench.config import (CaseConfig, ConfigError, RunConfig,
                             validate_case)
from parbench.overrides import apply_overrides


def _case(**ov) -> CaseConfig:
    return apply_overrides(CaseConfig(), {k: str(v) for k, v in ov.items()})


@pytest.mark.parametrize("field, value, words", [
    ("param_atol", 1e9, "param_atol=1e+09 cannot fail"),
    ("param_atol", 0.0121, "param_atol=0.0121 cannot fail"),
    ("rtol", 1.0, "rtol=1 must be < 1"),
    ("rtol", 5.0, "a tensor of zeros"),
])
def test_a_tolerance_that_cannot_fail_is_one_line_naming_field_value_and_rule(field, value,
                                                                            words):
    with pytest.raises(ConfigError) as e:
        validate_case(_case(**{field: value}))
    assert words in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("ov", [{}, {"param_atol": 6e-3, "rtol": 5e-2, "atol": 1e-2},
                                {"param_atol": 1e-4, "steps": 1, "timed_steps": 0},
                                {"optimizer": "sgd", "param_atol": 1.0}])
def test_the_stated_tolerances_in_use_are_accepted(ov):
    validate_case(_case(**ov))  # the defaults, the suites' bf16 rows, one step, SGD


def _two_copies(run: RunConfig, grads_a, grads_b) -> float:
    """Largest |a - b| after AdamW steps on two copies of the same weights."""
    a = torch.nn.Parameter(torch.linspace(-1, 1, len(grads_a[0]), dtype=torch.float64))
    b = torch.nn.Parameter(a.detach().clone())
    opts = [torch.optim.AdamW([p], lr=run.lr, betas=(run.beta1, run.beta2), eps=run.eps,
                              weight_decay=run.weight_decay) for p in (a, b)]
    for ga, gb in zip(grads_a, grads_b):
        for p, opt, g in ((a, opts[0], ga), (b, opts[1], gb)):
            p.grad = torch.tensor(g, dtype=torch.float64)
            opt.step()
    return float((a - b).detach().abs().max())


gradient = st.floats(-1e3, 1e3, allow_nan=False, allow_subnormal=False)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.data())
def test_no_two_gradient_sequences_move_copies_farther_apart_than_the_bound(n, data):
    run = RunConfig(steps=n, timed_steps=0)
    seq = st.lists(st.lists(gradient, min_size=3, max_size=3), min_size=n, max_size=n)
    got = _two_copies(run, data.draw(seq), data.draw(seq))
    assert got <= adamw_max_divergence(run)


def test_opposite_constant_gradients_come_within_one_percent_of_the_bound():
    run = RunConfig(steps=3, timed_steps=3)
    n = run.steps + run.timed_steps
    got = _two_copies(run, [[1.0, -2.0]] * n, [[-1.0, 2.0]] * n)
    assert 0.99 * adamw_max_divergence(run) < got <= adamw_max_divergence(run)


def test_the_divergence_bound_is_the_sum_of_the_step_bounds_and_linear_in_the_steps():
    from types import SimpleNamespace

    from parbench.tolerance_rules import adam_step_bound, adamw_max_divergence
    r = SimpleNamespace(steps=2, timed_steps=38, lr=1e-3, beta1=0.9, beta2=0.95)
    assert adamw_max_divergence(r) == 2e-3 * sum(adam_step_bound(t, 0.9, 0.95)
                                                 for t in range(1, 41))
    # a long run: 10^5 steps (quadratic before: the bound's series summed again every step)
    # and beta1^2 > beta2, where Adam's step has no bound (it overflowed before)
    long = SimpleNamespace(steps=2, timed_steps=100_000, lr=1e-3, beta1=0.9, beta2=0.95)
    assert 0 < adamw_max_divergence(long) < float("inf")
    assert adamw_max_divergence(SimpleNamespace(steps=2, timed_steps=5000, lr=1e-3,
                                                beta1=0.9, beta2=0.5)) == float("inf")
