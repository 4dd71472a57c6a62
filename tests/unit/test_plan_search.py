"""The planner's grouped branch and bound (``parbench.plan_search``): the memory counted per
group is ``memory_per_rank``'s, layout for layout; every group's and pipe's bound is at most
each member's lower bound, the shared pricing is ``predict_step``'s to the bit, and the top
list is the exhaustive search's on an MoE model."""
from __future__ import annotations

import pytest

from parbench.analytic.shape import shape_from
from parbench.config import model_preset
from parbench.plan import Space, layouts, plan, plan_groups
from parbench.plan_search import Bounds, _pipes, cap_of, fits_mask
from parbench.timemodel import load_profile, memory_per_rank, predict_step

SPACE = Space(micro_batch_sizes=(1, 2), zero_stages=(0, 1, 3))


@pytest.fixture(scope="module")
def moe():
    return shape_from(model_preset("mixtral-8x7b")), load_profile("h100")


def test_groups_hold_the_layouts_in_their_order(moe):
    shape, _ = moe
    groups = plan_groups(shape, 16, 32, SPACE)
    members = [g.member(si, oi) for g in groups for si in range(len(g.scheds))
               for oi in range(len(g.options))]
    assert members == list(layouts(shape, 16, 32, SPACE))
    assert [g.order for g in groups] == list(range(len(groups)))


def test_the_group_memory_count_is_memory_per_rank(moe):
    shape, prof = moe
    cap = cap_of(prof)
    seen = {True: 0, False: 0}
    for g in plan_groups(shape, 16, 32, SPACE):
        for si, row in enumerate(fits_mask(shape, g, cap)):
            for oi, ok in enumerate(row):
                assert ok == (memory_per_rank(shape, g.member(si, oi))[0] <= cap)
                seen[ok] += 1
    assert seen[True] and seen[False]  # both sides of the cap are exercised


def test_group_and_pipe_bounds_are_below_every_members_bound(moe):
    """The bounds that skip whole groups and pipes never exceed a member's own lower bound,
    and the pipe's shared pricing is predict_step's, bit for bit."""
    shape, prof = moe
    bounds = Bounds(shape, prof)
    groups = plan_groups(shape, 16, 32, SPACE)
    for g in groups[::20]:
        g.fits = [[True] * len(g.options) for _ in g.scheds]
        gb = bounds.group_bound(g)
        for pipe in _pipes(bounds, g):
            key = pipe.key()
            assert gb <= key
            for trn, lb in zip(pipe.trns, pipe.lower_bounds()):
                assert lb == predict_step(shape, trn, prof, bound=True).step_s
                assert key <= lb
            trn = pipe.trns[-1]
            assert pipe.step(trn) == predict_step(shape, trn, prof).step_s


@pytest.mark.parametrize("preset, world, batch", [("mixtral-8x7b", 16, 32),
                                                  ("deepseek-tiny", 8, 16)])
def test_branch_and_bound_is_exhaustive_on_moe(preset, world, batch):
    shape = shape_from(model_preset(preset))
    prof = load_profile("h100")
    fast = plan(shape, world, prof, batch, SPACE, keep=8)
    full = plan(shape, world, prof, batch, SPACE, keep=8, exhaustive=True)
    assert fast.evaluated == full.evaluated and fast.over_memory == full.over_memory
    assert [trn for trn, _ in fast.ranked] == [trn for trn, _ in full.ranked]
    assert [st.step_s for _, st in fast.ranked] == [st.step_s for _, st in full.ranked]
    # every layout that fits was either priced (its lower bound) or skipped with its group
    assert fast.bounded + fast.skipped == fast.evaluated - fast.over_memory
    assert fast.simulated <= fast.bounded < full.simulated


def test_the_cli_says_what_was_considered_priced_and_skipped(capsys):
    import json

    from parbench.cli import main
    args = ["plan", "model=gpt3-175b", "world=64", "device=h100", "max_cp=1", "top=3",
            "schedules=1f1b,zbv"]
    assert main(args + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bounded"] + out["skipped"] == out["evaluated"] - out["over_memory"]
    assert 0 < out["simulated"] <= out["bounded"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert f"{out['evaluated']} layouts considered" in text
    assert f"{out['skipped']} skipped" in text and "simulated" in text
