"""The planner's search space and ranking, with a stand-in predictor (the time model has its
own tests): the divisibility rules hold for every layout, memory prunes, and the ranking is
by predicted step time."""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from parbench.analytic.shape import shape_from
from parbench.config import ConfigError, model_preset
from parbench.plan import Space, layouts, plan


@dataclass
class FakeStep:
    step_s: float
    fits: bool
    tokens_per_s: float = 1.0
    mfu: float = 0.5
    compute_s: float = 0.0
    recompute_s: float = 0.0
    bubble_s: float = 0.0
    exposed_comm_s: dict = field(default_factory=dict)
    memory_per_rank_bytes: float = 0.0
    device_memory_bytes: float = 80 * 2**30
    heaviest_axis: str | None = None
    notes: list = field(default_factory=list)


def test_every_layout_obeys_the_rules():
    shape = shape_from(model_preset("gpt3-175b"))
    seen = 0
    for lay in layouts(shape, 64, 512):
        seen += 1
        assert lay.tp * lay.cp * lay.dp * lay.pp == 64
        assert shape.a % lay.tp == 0 and shape.l % lay.pp == 0 and lay.tp <= 8
        assert shape.s % (2 * lay.cp) == 0
        assert 512 % (lay.dp * lay.micro_batch_size) == 0
        assert lay.num_microbatches * lay.dp * lay.micro_batch_size == 512
        if lay.pp > 1:
            assert lay.num_microbatches >= lay.pp
        if lay.vpp > 1:
            assert lay.schedule in ("interleaved", "zbv", "dualpipev")
            assert (shape.l // lay.pp) % lay.vpp == 0
        if lay.schedule == "interleaved":
            assert lay.num_microbatches % lay.pp == 0
        if lay.schedule in ("zbv", "dualpipev"):
            assert lay.vpp == 2
        if lay.schedule == "zb-h2":
            assert lay.num_microbatches >= 2 * lay.pp - 1
        if lay.schedule == "dualpipev":
            assert lay.num_microbatches >= 2 * lay.pp
        if lay.dp == 1:
            assert lay.zero_stage == 0
    assert seen > 1000


def test_ranked_by_step_time_and_pruned_by_memory():
    shape = shape_from(model_preset("gpt3-175b"))

    def fake(shape, lay, profile):  # faster with more tp; over memory without pipelining
        return FakeStep(step_s=10.0 / lay.tp + lay.zero_stage, fits=lay.pp > 1)

    res = plan(shape, 64, None, 512, Space(recomputes=("none",)), predictor=fake, keep=5)
    times = [st.step_s for _, st in res.ranked]
    assert times == sorted(times) and len(times) == 5
    assert all(lay.pp > 1 for lay, _ in res.ranked)
    assert res.over_memory > 0 and res.evaluated > res.over_memory
    assert res.ranked[0][0].tp == 8 and res.ranked[0][0].zero_stage == 0


def test_bad_world_is_rejected():
    shape = shape_from(model_preset("gpt3-175b"))
    with pytest.raises(ConfigError, match="world"):
        plan(shape, 0, None, 8, predictor=lambda *a: None)


@pytest.mark.parametrize("preset, world, batch", [("gpt3-175b", 16, 32), ("small", 8, 64)])
def test_branch_and_bound_finds_the_exhaustive_top_list(preset, world, batch):
    """The planner simulates only layouts whose lower bound (no bubble) could still make the
    top list; its top list and counts must be the exhaustive search's, layout for layout."""
    from parbench.timemodel import load_profile, predict_step
    shape = shape_from(model_preset(preset))
    prof = load_profile("a100-80gb")
    space = Space(micro_batch_sizes=(1, 2), zero_stages=(0, 1, 3))
    fast = plan(shape, world, prof, batch, space, keep=8)
    full = plan(shape, world, prof, batch, space, keep=8, exhaustive=True)
    assert fast.evaluated == full.evaluated and fast.over_memory == full.over_memory
    assert [lay for lay, _ in fast.ranked] == [lay for lay, _ in full.ranked]
    assert [lay for lay, _ in fast.best_over_memory] == [lay for lay, _ in full.best_over_memory]
    # the bound is a bound: never above the simulated step
    for lay, st in full.ranked:
        assert predict_step(shape, lay, prof, bound=True).step_s <= st.step_s * (1 + 1e-9)
