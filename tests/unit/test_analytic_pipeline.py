"""The closed forms of ``parbench.analytic.pipeline`` against the schedules and the model.

The analytic module takes the placement kind, p, m and v as plain numbers; here its figures
meet the transfer lists the generators produce (``Schedule.comm``), the continuous run cut
into steps, and the parameters of the stages ``parbench.model`` builds. A disagreement is a
bug in a generator, the cut or the formula -- the executor's prediction no longer reads the
schedule it runs, so this is now a test of the schedules.
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from parbench.analytic import pipeline as closed
from parbench.analytic.shape import Shape, shape_from
from parbench.config import ModelConfig
from parbench.model import build_stage
from parbench.schedules import (
    SCHEDULES,
    ScheduleError,
    continuous_schedule,
    make_schedule,
    step_bounds,
)
from parbench.schedules.actions import BACKWARD_FULL, FORWARD

#: (p, m, v) combinations; a schedule that refuses one is skipped for it
SHAPES = [(p, m, v) for p in (2, 3, 4) for m in (1, 2, 4, 6, 8, 9) for v in (1, 2, 3)]


def _cases():
    for name, spec in SCHEDULES.items():
        for p, m, v in SHAPES:
            try:
                s = make_schedule(name, p, m, v if spec.chunks.value == "any" else None)
            except ScheduleError:
                continue
            if spec.chunks.value == "any" and s.v != v:
                continue
            yield pytest.param(s, id=f"{name}-p{p}-m{m}-v{s.v}")


@pytest.mark.parametrize("schedule", list(_cases()))
def test_sends_per_rank_are_the_generated_transfers(schedule):
    placement = str(SCHEDULES[schedule.name].placement)
    counted = Counter((t.src_rank, t.kind) for t in schedule.comm())
    for r in range(schedule.p):
        fwd, bwd = closed.p2p_sends(placement, schedule.p, schedule.m, r, schedule.v)
        assert (counted[(r, "act")], counted[(r, "grad")]) == (fwd, bwd), (r, placement)
        assert closed.stages_on_rank(placement, schedule.p, r, schedule.v) == \
            schedule.stages_of(r)
    assert closed.num_stages(placement, schedule.p, schedule.v) == schedule.num_stages


@pytest.mark.parametrize("name", ["pipedream", "2bw"])
@pytest.mark.parametrize("p,m,steps", [(2, 2, 3), (2, 4, 4), (3, 3, 2), (4, 4, 3), (4, 8, 4),
                                       (4, 5, 1)])
def test_continuous_steps_send_and_carry_what_the_closed_form_says(name, p, m, steps):
    run = continuous_schedule(name, p, m, steps)
    bounds = step_bounds(run, m, steps)
    for r in range(p):
        row = run.actions[r]
        covered = []
        forwards = backwards = 0
        for t in range(steps):
            lo, hi = bounds[t][r]
            part = row[lo:hi]
            covered += part
            acts = sum(a.kind == FORWARD and a.stage < p - 1 for a in part)
            grads = sum(a.kind == BACKWARD_FULL and a.stage > 0 for a in part)
            assert (acts, grads) == closed.async_step_sends(p, m, r, t, steps), (r, t)
            # a step runs the forwards of its own micro-batches
            assert sorted(a.mb for a in part if a.kind == FORWARD) == \
                list(range(t * m, (t + 1) * m))
            forwards += sum(a.kind == FORWARD for a in part)
            backwards += sum(a.kind == BACKWARD_FULL for a in part)
            assert backwards == closed.backwards_done(p, m, r, t, steps)
            assert forwards - backwards == closed.async_in_flight(p, m, r, t, steps)
        assert covered == row  # the steps partition the run


@pytest.mark.parametrize("layers,stages", [(4, 1), (4, 2), (4, 4), (8, 4), (6, 3)])
@pytest.mark.parametrize("positions", [True, False])
def test_stage_parameters_are_the_models(layers, stages, positions):
    cfg = ModelConfig(num_layers=layers, hidden_size=16, num_heads=2, seq_length=8,
                      vocab_size=64, position_embeddings=positions)
    shape = shape_from(cfg)
    for s in range(stages):
        with torch.device("meta"):
            stage = build_stage(cfg, 0, s, stages)
        params = list(stage.parameters())
        assert sum(t.numel() for t in params) == closed.stage_numel(shape, stages, s)
        assert len(params) == closed.stage_tensors(shape, stages, s)


def test_model_states_count_versions_and_adamw():
    shape = Shape(vocab_size=64, hidden_size=16, num_layers=4, num_heads=2, seq_length=8)
    n = closed.stage_numel(shape, 4, 1)
    k = closed.stage_tensors(shape, 4, 1)
    sync = closed.model_states(shape, "linear", 4, 1)
    assert sync == {"params": 4 * n, "grads": 4 * n, "optimizer": 8 * n + 4 * k, "other": 0}
    assert closed.model_states(shape, "linear", 4, 1, rule="pipedream")["params"] == 3 * 4 * n
    assert closed.model_states(shape, "linear", 4, 3, rule="pipedream")["params"] == \
        4 * closed.stage_numel(shape, 4, 3)
    assert closed.model_states(shape, "linear", 4, 1, rule="2bw")["params"] == 2 * 4 * n
    assert closed.model_states(shape, "linear", 4, 1, optimizer="sgd")["optimizer"] == 0


def test_two_replicas_add_one_gradient_exchange():
    shape = Shape(vocab_size=64, hidden_size=16, num_layers=4, num_heads=2, seq_length=8)
    act = closed.boundary_bytes(1, 8, 16)
    for r in range(4):
        wire, calls = closed.step_traffic(shape, "bidirectional", 4, 8, r, b=1)
        fwd, bwd = closed.p2p_sends("bidirectional", 4, 8, r)
        assert calls == fwd + bwd + 1
        assert wire == (fwd + bwd) * act + 4 * (closed.stage_numel(shape, 4, r)
                                                + closed.stage_numel(shape, 4, 3 - r))


def test_bad_arguments_name_the_field():
    with pytest.raises(ValueError, match="placement='ring'"):
        closed.num_stages("ring", 4)
    with pytest.raises(ValueError, match="m=3"):
        closed.p2p_sends("bidirectional", 4, 3, 0)
    with pytest.raises(ValueError, match="num_stages=3"):
        closed.stage_numel(Shape(vocab_size=8, hidden_size=4, num_layers=4, num_heads=1,
                                 seq_length=2), 3, 0)
