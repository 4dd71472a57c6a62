"""The planner's search space and ranking, with a stand-in predictor (the time model has its
own tests): the divisibility rules hold for every layout, memory prunes, and the ranking is
by predicted step time."""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from hypothesis import given, settings
from hypothesis import strategies as st

from parbench.analytic.shape import shape_from
from parbench.config import PRESETS, ConfigError, model_preset
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
    seen, schedules = 0, set()
    for trn in layouts(shape, 64, 512):
        lay, opt = trn.layout, trn.options
        seen += 1
        assert lay.tp * lay.cp * lay.dp * lay.pp == 64
        assert shape.a % lay.tp == 0 and shape.l % lay.pp == 0 and lay.tp <= 8
        assert shape.s % (2 * lay.cp) == 0
        assert 512 % (lay.dp * lay.micro_batch_size) == 0
        assert lay.num_microbatches * lay.dp * lay.micro_batch_size == 512
        if lay.pp > 1:
            assert lay.num_microbatches >= lay.pp
        schedules.add(lay.schedule)
        if lay.vpp > 1:
            assert lay.schedule in ("interleaved", "zbv", "dualpipev", "vhalf", "vmin")
            assert (shape.l // lay.pp) % lay.vpp == 0
        if lay.schedule == "interleaved":  # the generator's grouping (looped.interleaved)
            assert lay.num_microbatches % max(1, lay.num_microbatches // lay.pp) == 0
        if lay.schedule in ("zbv", "dualpipev", "vhalf", "vmin"):
            assert lay.vpp == 2
        if lay.schedule == "zb-h2":
            assert lay.num_microbatches >= 2 * lay.pp - 1
        if lay.schedule == "dualpipev":
            assert lay.num_microbatches >= 2 * lay.pp
        if lay.dp == 1:
            assert opt.data.zero_stage == 0
    assert seen > 1000
    assert {"vhalf", "vmin", "zbv", "interleaved"} <= schedules  # the default space's V shapes


#: every preset the planner may be asked about, local and published
PLAN_PRESETS = sorted(PRESETS)


@given(world=st.integers(1, 16384), preset=st.sampled_from(PLAN_PRESETS),
       batch_per_rank=st.sampled_from([1, 2, 3]))
@settings(max_examples=40, deadline=None)
def test_the_planner_never_proposes_what_the_rules_reject(world, preset, batch_per_rank):
    """The bug this guards: ``plan model=gpt3-175b world=96`` proposed tp=3 with sequence
    parallelism although 3 does not divide the sequence, and crashed. Every candidate of
    every world size and preset must pass the layout's rules (``Layout.check_model``, with
    SP as the candidate sets it) and the options' own checks."""
    shape = shape_from(model_preset(preset))
    for i, trn in enumerate(layouts(shape, world, world * batch_per_rank,
                                    Space(recomputes=("none",), zero_stages=(0,)))):
        assert trn.layout.world_size == world
        trn.layout.check_model(shape, sp=trn.options.tensor.sp)
        if i > 2000:  # the rules are per grid; a few thousand candidates cover every grid
            break


def test_ranked_by_step_time_and_pruned_by_memory():
    shape = shape_from(model_preset("gpt3-175b"))

    def fake(shape, trn, profile):  # faster with more tp; over memory without pipelining
        lay, opt = trn.layout, trn.options
        return FakeStep(step_s=10.0 / lay.tp + opt.data.zero_stage, fits=lay.pp > 1)

    res = plan(shape, 64, None, 512, Space(recomputes=("none",)), predictor=fake, keep=5)
    times = [st.step_s for _, st in res.ranked]
    assert times == sorted(times) and len(times) == 5
    assert all(trn.layout.pp > 1 for trn, _ in res.ranked)
    assert res.over_memory > 0 and res.evaluated > res.over_memory
    best = res.ranked[0][0]
    assert best.layout.tp == 8 and best.options.data.zero_stage == 0


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
    assert [trn for trn, _ in fast.ranked] == [trn for trn, _ in full.ranked]
    assert [trn for trn, _ in fast.best_over_memory] == [trn for trn, _ in full.best_over_memory]
    # the bound is a bound: never above the simulated step
    for trn, st in full.ranked:
        assert predict_step(shape, trn, prof, bound=True).step_s <= st.step_s * (1 + 1e-9)


def test_v_half_wins_where_its_activation_memory_lets_a_layout_fit():
    """llama2-70b on 32 A100-80GB, 64 sequences, no recomputation: the fastest layouts keep
    ZB-V's and 1F1B's p micro-batches of activations over the device's memory; V-Half keeps
    about half (Qi et al. 2024b, Sec. 4.1) and fits, so the planner ranks it first -- and
    without V-Half and V-Min in the space the best step is much slower."""
    from dataclasses import replace

    from parbench.timemodel import load_profile, predict_step
    shape = shape_from(model_preset("llama2-70b"))
    prof = load_profile("a100-80gb")
    space = Space(micro_batch_sizes=(1,), zero_stages=(3,), recomputes=("none",))
    res = plan(shape, 32, prof, 64, space, keep=3)
    best, step = res.ranked[0]
    assert best.layout.schedule in ("vhalf", "vmin") and best.layout.vpp == 2
    for other, vpp in (("zbv", 2), ("1f1b", 1), ("dualpipev", 2)):
        lay = replace(best.layout, schedule=other, vpp=vpp)
        assert not predict_step(shape, replace(best, layout=lay), prof).fits
    without = replace(space, schedules=tuple(s for s in space.schedules
                                             if s not in ("vhalf", "vmin")))
    rest = plan(shape, 32, prof, 64, without, keep=1)
    assert rest.ranked[0][1].step_s > step.step_s


def test_unpriced_schedules_are_skipped_with_their_reason():
    """Seq1F1B and TeraPipe need a token-slice count the time model's layout lacks: the
    planner does not search them and says why (``parbench plan`` prints the line)."""
    from parbench.plan import unpriced
    from parbench.schedules import SCHEDULES
    shape = shape_from(model_preset("small"))
    space = Space(schedules=("seq1f1b", "terapipe", "1f1b"), micro_batch_sizes=(1,),
                  zero_stages=(0,), recomputes=("none",))
    searched = {trn.layout.schedule for trn in layouts(shape, 8, 64, space)}
    assert searched == {"1f1b"}
    reasons = unpriced(Space(schedules=tuple(SCHEDULES)))
    assert set(reasons) == {"seq1f1b", "terapipe"}
    assert all("token-slice" in why for why in reasons.values())


def test_the_search_covers_the_context_parallel_algorithms_and_expert_tp():
    """Issue 22, sec. 2: cp > 1 is searched with every algorithm the model admits (Ulysses
    only where cp divides each tensor-parallel rank's query and key-value heads), and a MoE
    model with etp = 1 as well as etp = tp, always inside Megatron-Core's expert grid."""
    llama = shape_from(model_preset("llama3-70b"))  # 64 heads, 8 key-value heads
    algos = {}
    for trn in layouts(llama, 64, 64, Space(recomputes=("none",), zero_stages=(0,),
                                            micro_batch_sizes=(1,), schedules=("1f1b",))):
        lay, algo = trn.layout, trn.options.context.cp_algorithm
        if lay.cp > 1:
            algos.setdefault((lay.tp, lay.cp), set()).add(algo)
            if algo == "ulysses":
                assert (64 // lay.tp) % lay.cp == 0 and max(8 // lay.tp, 1) % lay.cp == 0
    assert algos[(1, 8)] == {"ring-attention", "ulysses", "allgather"}
    assert algos[(8, 2)] == {"ring-attention", "allgather"}  # 1 kv head per tp rank
    moe = shape_from(model_preset("ubmesh-moe-2t"))
    etps = set()
    for trn in layouts(moe, 64, 64, Space(recomputes=("none",), zero_stages=(0,),
                                          micro_batch_sizes=(1,), schedules=("1f1b",),
                                          cp_algorithms=("ring-attention",))):
        lay = trn.layout
        etp = lay.etp or lay.tp
        assert lay.tp % etp == 0 and (lay.tp * lay.cp * lay.dp) % (etp * lay.ep) == 0
        etps.add((lay.tp, etp))
    assert (4, 1) in etps and (4, 4) in etps


def test_the_planner_ranks_whatever_algorithm_wins():
    shape = shape_from(model_preset("llama3-70b"))

    def fake(shape, trn, profile):  # Ulysses fastest; cp = 8 needed to fit
        lay = trn.layout
        fast = trn.options.context.cp_algorithm == "ulysses"
        return FakeStep(step_s=1.0 if fast else 2.0, fits=lay.cp == 8)

    res = plan(shape, 64, None, 64, Space(recomputes=("none",), zero_stages=(0,),
                                          micro_batch_sizes=(1,), schedules=("1f1b",)),
               predictor=fake, keep=3)
    assert all(t.layout.cp == 8 and t.options.context.cp_algorithm == "ulysses"
               for t, _ in res.ranked)
