"""The continuous (no-flush) pipelines: the run's 1F1B cut into harness steps, the steady
step as a window, and its closed-form bubble."""
from __future__ import annotations

import pytest

from parbench.schedules import (
    ScheduleError,
    continuous_schedule,
    relabel,
    simulate,
    steady_closed_form,
    steady_step,
    step_bounds,
    validate,
)
from parbench.schedules.actions import FORWARD


@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (3, 2), (3, 3), (4, 4), (4, 8), (6, 7)])
@pytest.mark.parametrize("tf,tb,tw", [(1, 1, 1), (1, 2, 0), (2, 1, 1), (1, 3, 0.5)])
def test_steady_step_bubble_is_one_forward_ramp(p, m, tf, tb, tw):
    """Exact for m >= p-1: each rank idles (p-1) T_F per step between barriers."""
    step = steady_step("pipedream", p, m)
    sim = simulate(step, tf=tf, tb=tb, tw=tw)
    form = steady_closed_form(p, m, tf, tb, tw)
    if m >= p - 1:
        assert sim.bubble == pytest.approx(form.bubble_ratio)
        assert sim.idle_time == pytest.approx([(p - 1) * tf] * p)
    else:  # fewer micro-batches than the warm-up: the ramp is not all
        assert sim.bubble >= form.bubble_ratio - 1e-12


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (5, 5)])
def test_steady_step_counts_the_carried_micro_batches(p, m):
    sim = simulate(steady_step("2bw", p, m))
    assert sim.peak_inflight == [p - r for r in range(p)]
    assert sim.peak_held == sim.peak_inflight  # fused backwards free the graph


def test_a_window_is_not_a_whole_schedule():
    with pytest.raises(ScheduleError, match="done_before"):
        validate(steady_step("pipedream", 2, 4))
    with pytest.raises(ScheduleError, match="does not run continuously"):
        continuous_schedule("1f1b", 2, 4, 3)


def test_steps_start_at_the_step_forward_and_relabel_to_the_steady_window():
    p, m, steps = 3, 4, 5
    run = continuous_schedule("pipedream", p, m, steps)
    bounds = step_bounds(run, m, steps)
    window = steady_step("pipedream", p, m)
    for t in range(1, steps - 1):
        for r in range(p):
            lo, hi = bounds[t][r]
            first = run.actions[r][lo]
            assert first.kind == FORWARD and first.mb == t * m
            shifted = [(a.kind, relabel(a.mb, t, m), a.stage) for a in run.actions[r][lo:hi]]
            assert shifted == [(a.kind, a.mb, a.stage) for a in window.actions[r]]
    last = [run.actions[r][bounds[-1][r][0]:bounds[-1][r][1]] for r in range(p)]
    assert [len(x) for x in last] == [2 * m + (p - 1 - r) for r in range(p)]  # the drain
