"""Schedules as data: generators, the validator and simulator invariants.

Closed forms live in test_schedules_closed_forms.py, rendering in
test_schedules_render.py.  Hypothesis settings come from a profile:
``schedules-ci`` (default, fast) or ``schedules-thorough`` when
HYPOTHESIS_PROFILE=thorough.
"""
from __future__ import annotations

import dataclasses
import os
import random

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from parbench.schedules import (
    SCHEDULES,
    Action,
    ChunkRule,
    ExecutorKind,
    WeightRule,
    Placement,
    Schedule,
    ScheduleError,
    make_schedule,
    simulate,
    validate,
)
from parbench.schedules.actions import (
    bidirectional_placement,
    linear_placement,
    looped_placement,
    v_placement,
    wave_placement,
)

settings.register_profile("schedules-ci", max_examples=40, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("schedules-thorough", max_examples=400, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
PROFILE = settings.get_profile(
    "schedules-thorough" if os.environ.get("HYPOTHESIS_PROFILE") == "thorough" else "schedules-ci")


def supported(name: str, p: int, m: int, v: int | None) -> bool:
    """The generators' documented preconditions, restated independently."""
    single = v in (None, 1)
    if name in ("gpipe", "1f1b", "pipedream", "2bw", "zb-h1", "seq1f1b", "terapipe",
                "bpipe"):
        return single
    if name == "zb-h2":
        return single and m >= 2 * p - 1
    if name == "interleaved":
        rounds = max(1, m // p)
        return (v is None or v >= 2) and m % rounds == 0
    if name == "bfs":
        return True
    if name == "zbv":
        return v in (None, 2)
    if name == "chimera":
        return single and p % 2 == 0 and m % p == 0
    if name == "dualpipe":
        return single and p % 2 == 0 and m % 2 == 0 and m >= 2 * p
    if name == "dualpipev":
        return v in (None, 2) and m >= 2 * p
    if name == "hanayo":
        return v is None or v >= 2
    if name in ("vhalf", "vmin"):
        return v in (None, 2)
    raise AssertionError(name)


names = st.sampled_from(sorted(SCHEDULES))
shapes = st.tuples(names, st.integers(1, 8), st.integers(1, 20), st.sampled_from([None, 1, 2, 3, 4]))


@PROFILE
@given(shapes)
def test_generated_schedules_validate_or_refuse_clearly(shape):
    name, p, m, v = shape
    if supported(name, p, m, v):
        schedule = validate(make_schedule(name, p, m, v))
        assert (schedule.name, schedule.p, schedule.m) == (name, p, m)
        assert schedule.num_actions() == sum(len(r) for r in schedule.actions)
    else:
        with pytest.raises(ScheduleError) as err:
            make_schedule(name, p, m, v)
        message = str(err.value)
        assert name in message and "needs" in message
        assert any(f"{k}=" in message for k in ("p", "m", "v")), message


@PROFILE
@given(shapes)
def test_the_spec_states_the_generators_rules(shape):
    """``ScheduleSpec.refusal`` (what the planner reads) refuses exactly what the generator
    refuses, and ``min_microbatches`` is the generator's floor."""
    name, p, m, v = shape
    spec = SCHEDULES[name]
    assert (spec.refusal(p, m, v) is None) == supported(name, p, m, v)
    least = spec.min_microbatches(p)
    if least > 1 and supported(name, p, least, v):
        assert f"needs m >= {spec.min_m} = {least}" in spec.refusal(p, least - 1, v)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_spec_facts_other_modules_read(name):
    """splits_backward is what the generator emits; the weight rule and the executor agree
    (an asynchronous rule runs continuously); the memory rule and note are stated; a
    schedule the time model cannot price says why."""
    spec = SCHEDULES[name]
    schedule = make_schedule(name, 4, 8)
    has_w = any(a.kind == "W" for _, _, a in schedule.iter_actions())
    assert spec.splits_backward == schedule.split_backward == has_w
    assert spec.asynchronous == (spec.executor is ExecutorKind.ASYNCHRONOUS)
    assert spec.asynchronous == (spec.weight_rule is not WeightRule.SYNC)
    assert spec.memory_note and spec.memory(4, 8, schedule.v, 0) >= 1
    assert spec.priced == (spec.unpriced == "")
    assert str(spec.min_m) and spec.min_microbatches(4) >= 1
    if spec.max_inflight is not None and spec.chunks is ChunkRule.ONE:
        assert spec.memory(4, 8, 1, 0) >= spec.max_inflight(4, 8, 0) or \
            spec.executor is ExecutorKind.BPIPE  # BPipe evicts what 1F1B holds


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_schedule_validates_at_a_common_shape(name):
    p, m = 4, 8
    schedule = validate(make_schedule(name, p, m))
    pipes = set(schedule.mb_pipe)
    two_replicas = SCHEDULES[name].placement is Placement.BIDIRECTIONAL
    assert pipes == ({0, 1} if two_replicas else {0})
    # every rank holds v stages of each replica
    for rank in range(p):
        assert len(schedule.stages_of(rank)) == schedule.v * len(pipes)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_spec_metadata_matches_what_the_generator_builds(name):
    """A schedule's spec (placement kind, chunks, asynchronous) is what its generator does."""
    spec = SCHEDULES[name]
    assert spec.name == name and spec.description
    p, m = 4, 8
    schedule = make_schedule(name, p, m)
    assert schedule.asynchronous == spec.asynchronous
    expected = {Placement.LINEAR: lambda: linear_placement(p),
                Placement.LOOPED: lambda: looped_placement(p, schedule.v),
                Placement.V: lambda: v_placement(p),
                Placement.BIDIRECTIONAL: lambda: bidirectional_placement(p),
                Placement.WAVE: lambda: wave_placement(p, schedule.v)}[spec.placement]()
    assert schedule.placement == expected
    if spec.chunks is ChunkRule.ONE:
        assert schedule.v == 1 and spec.v_for(1) is None
        with pytest.raises(ScheduleError, match=f"vpp=2: {name} holds one stage per rank"):
            spec.v_for(2)
    elif spec.chunks is ChunkRule.TWO:
        assert schedule.v == 2 and spec.v_for(1) is None and spec.v_for(2) is None
        with pytest.raises(ScheduleError, match=f"vpp=3: {name} always holds 2 stages"):
            spec.v_for(3)
    else:
        assert spec.v_for(1) is None and spec.v_for(3) == 3
        assert make_schedule(name, p, m, spec.v_for(3)).v == 3


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved", "bfs", "pipedream", "2bw"])
def test_split_backward_variants_validate(name):
    s = validate(make_schedule(name, 4, 8, split_backward=True))
    assert s.split_backward and {a.kind for _, _, a in s.iter_actions()} == {"F", "B", "W"}


def test_refusals_name_field_value_and_rule():
    cases = {
        ("chimera", 3, 6, None): "chimera needs an even p (got p=3)",
        ("chimera", 4, 6, None): "chimera needs m to be a multiple of p (got m=6, p=4)",
        ("dualpipe", 4, 6, None): "dualpipe needs m >= 2p = 8 (got m=6, p=4)",
        ("dualpipe", 4, 9, None): "dualpipe needs an even m (got m=9)",
        ("dualpipev", 4, 7, None): "dualpipev needs m >= 2p = 8 (got m=7, p=4)",
        ("zb-h2", 4, 6, None): "zb-h2 needs m >= 2p-1 = 7 (got m=6, p=4)",
        ("zbv", 4, 8, 3): "zbv needs v=2 (got v=3)",
        ("interleaved", 4, 8, 1): "interleaved needs v >= 2 (got v=1)",
        ("gpipe", 4, 8, 2): "gpipe needs v=1 (got v=2)",
        ("1f1b", 0, 8, None): "1f1b needs a positive integer p (got p=0)",
    }
    for (name, p, m, v), message in cases.items():
        with pytest.raises(ScheduleError, match=message.replace("(", r"\(").replace(")", r"\)")):
            make_schedule(name, p, m, v)
    with pytest.raises(ScheduleError, match="interleaved needs m to be a multiple of rounds"):
        make_schedule("interleaved", 4, 9, 2)
    with pytest.raises(ScheduleError, match="unknown schedule name='nope'"):
        make_schedule("nope", 4, 8)
    with pytest.raises(ScheduleError, match="takes no option"):
        make_schedule("zb-h1", 4, 8, bogus=1)
    assert issubclass(ScheduleError, ValueError)


# -- the data model -------------------------------------------------------------
def test_action_and_label_text():
    assert str(Action("F", 3, 0)) == "F3s0"
    assert str(Action("BW", 3, 5, 1)) == "BW3s5p1"
    one = make_schedule("1f1b", 4, 8)
    assert one.label(Action("F", 3, 2)) == "F3"
    looped = make_schedule("interleaved", 4, 8, 2)
    assert looped.label(Action("B" if looped.split_backward else "BW", 3, 6)) == "BW3c1"
    v = make_schedule("zbv", 4, 8)
    assert v.rank_of(Action("F", 0, 7)) == 0 and v.chunk_of(0, 7) == 1
    bi = make_schedule("chimera", 4, 8)
    assert bi.rank_of(Action("F", 5, 0, 1)) == 3 and bi.mb_pipe[5] == 1


def _independent_transfers(schedule):
    """Cross-rank boundaries from placement alone: one activation and one gradient each."""
    count = 0
    for mb in range(schedule.m):
        pipe = schedule.mb_pipe[mb]
        for s in range(schedule.num_stages - 1):
            if schedule.placement[(pipe, s)] != schedule.placement[(pipe, s + 1)]:
                count += 2
    return count


@PROFILE
@given(shapes)
def test_transfers_match_placement(shape):
    name, p, m, v = shape
    assume(supported(name, p, m, v))
    schedule = make_schedule(name, p, m, v)
    transfers = schedule.comm()
    assert len(transfers) == _independent_transfers(schedule)
    for t in transfers:
        assert t.src_rank != t.dst_rank
        assert t.src_rank == schedule.placement[(t.pipe, t.src_stage)]
        assert t.dst_rank == schedule.placement[(t.pipe, t.dst_stage)]
        assert t.dst_stage - t.src_stage == (1 if t.kind == "act" else -1)


# -- simulator invariants ---------------------------------------------------------
costs = st.sampled_from([0.25, 0.5, 1.0, 1.5, 2.0, 3.0])


@PROFILE
@given(shapes, costs, costs, costs, st.sampled_from([0.0, 0.0, 0.3]), st.booleans())
def test_simulator_invariants(shape, tf, tb, tw, p2p, per_stage):
    name, p, m, v = shape
    assume(supported(name, p, m, v))
    schedule = make_schedule(name, p, m, v)
    S = schedule.num_stages
    if per_stage:  # a different cost per stage, as a list and as a dict
        tf_arg = [tf * (1 + 0.1 * s) for s in range(S)]
        tb_arg = {s: tb * (1 + 0.05 * s) for s in range(S)}
    else:
        tf_arg, tb_arg = tf, tb

    def own_cost(a):
        f = tf_arg[a.stage] if per_stage else tf
        b = tb_arg[a.stage] if per_stage else tb
        return {"F": f, "B": b, "W": tw, "BW": b + tw}[a.kind]

    sim = simulate(schedule, tf_arg, tb_arg, tw, p2p=p2p)
    assert sim.makespan >= max(sim.busy) - 1e-9
    assert sim.bubble >= -1e-12 and all(b >= -1e-12 for b in sim.bubble_per_rank)
    kinds = schedule.backward_kinds()
    for rank, row in enumerate(schedule.actions):
        assert sim.busy[rank] == pytest.approx(sum(own_cost(a) for a in row))
        idle = sum(e - s for s, e in sim.idle[rank])
        assert idle == pytest.approx(sim.makespan - sim.busy[rank])
        previous_end = 0.0
        for a in row:  # in order, no overlap, durations as costed
            start, end = sim.times[a]
            assert start >= previous_end - 1e-9
            assert end - start == pytest.approx(own_cost(a))
            previous_end = end
            for dep in schedule.dependencies(a, kinds):
                lag = p2p if schedule.rank_of(dep) != rank else 0.0
                assert start >= sim.times[dep][1] + lag - 1e-9
        forwards = len([a for a in row if a.kind == "F"])
        assert sim.peak_inflight[rank] >= 1 and sim.peak_inflight[rank] <= forwards
    assert sim.bubble == pytest.approx(1 - sum(sim.busy) / (p * sim.makespan))


def test_costs_override_and_callable():
    schedule = make_schedule("1f1b", 2, 2)
    base = simulate(schedule)
    slow = Action("F", 0, 0)
    sim = simulate(schedule, costs={slow: 5.0})
    assert sim.times[slow] == (0.0, 5.0)
    assert sim.makespan == base.makespan + 4.0  # F0 on rank 0 heads the critical path
    doubled = simulate(schedule, cost=lambda a: 2.0 * (1.0 if a.kind == "F" else 2.0))
    assert doubled.makespan == 2 * base.makespan
    assert simulate(schedule, tbw=5.0).busy[0] == 2 * 1.0 + 2 * 5.0


def test_overlap_mode_is_never_faster_than_sequential():
    for name, p, m in [("dualpipe", 4, 8), ("dualpipe", 6, 16), ("dualpipev", 3, 8)]:
        schedule = make_schedule(name, p, m)
        assert schedule.overlapped
        for tf, tb, tw in [(1, 1, 1), (2, 1, 1), (1, 2, 0.5)]:
            seq = simulate(schedule, tf, tb, tw)
            unit = simulate(schedule, tf, tb, tw, overlap=True)
            assert seq.makespan <= unit.makespan + 1e-9
            assert unit.busy == pytest.approx(seq.busy)  # tfb defaults to F + B
        # unit costs: F + BW = 3; an F&B unit of 2 saves 1 per pair on each rank
        plain = simulate(schedule, overlap=True)
        faster = simulate(schedule, overlap=True, tfb=lambda f, b: 2.0)
        pairs = len([f for f, _ in schedule.overlapped if schedule.rank_of(f) == 0])
        assert pairs > 0 and faster.busy[0] == pytest.approx(plain.busy[0] - pairs)


# -- the validator rejects broken schedules --------------------------------------
def _copy(schedule: Schedule, **changes) -> Schedule:
    rows = [list(r) for r in schedule.actions]
    return dataclasses.replace(schedule, actions=rows, **changes)


def test_validator_rejects_missing_and_duplicate_actions():
    good = make_schedule("1f1b", 3, 4)
    s = _copy(good)
    s.actions[1].remove(Action("F", 2, 1))
    with pytest.raises(ScheduleError, match=r"missing F for mb=2 stage=1 pipe=0"):
        validate(s)
    s = _copy(good)
    s.actions[2].append(Action("BW", 0, 2))
    with pytest.raises(ScheduleError, match=r"duplicate BW0s2 \(2 times\)"):
        validate(s)
    split = make_schedule("zb-h1", 3, 4)
    s = _copy(split)
    s.actions[0].remove(Action("W", 3, 0))
    with pytest.raises(ScheduleError, match=r"missing W for mb=3 stage=0"):
        validate(s)
    s = _copy(split)
    s.actions[0].append(Action("BW", 3, 0))
    with pytest.raises(ScheduleError, match=r"has both BW and B/W"):
        validate(s)


def test_validator_rejects_wrong_placement_pipe_and_kind():
    good = make_schedule("1f1b", 3, 4)
    s = _copy(good)
    s.actions[0][0], s.actions[1][0] = s.actions[1][0], s.actions[0][0]
    with pytest.raises(ScheduleError, match=r"stage 1 of pipe 0 lives on rank 1"):
        validate(s)
    s = _copy(good)
    s.actions[0].append(Action("F", 9, 0))
    with pytest.raises(ScheduleError, match=r"mb=9 is outside 0..3"):
        validate(s)
    s = _copy(good)
    s.actions[0][0] = Action("B", 0, 0)
    with pytest.raises(ScheduleError, match=r"B in a schedule with split_backward=False"):
        validate(s)
    bi = make_schedule("chimera", 2, 2)
    s = _copy(bi)
    s.actions[0] = [Action(a.kind, a.mb, a.stage, 1 - a.pipe) if a.mb == 0 else a for a in s.actions[0]]
    with pytest.raises(ScheduleError, match=r"but micro-batch 0 uses pipe 0"):
        validate(s)


def test_validator_rejects_same_rank_order_violation():
    s = _copy(make_schedule("gpipe", 2, 2))
    row = s.actions[1]
    i, j = row.index(Action("F", 1, 1)), row.index(Action("BW", 1, 1))
    row[i], row[j] = row[j], row[i]
    with pytest.raises(ScheduleError, match=r"rank 1: BW1s1 at position \d+ needs F1s1, which comes later"):
        validate(s)


def test_validator_detects_cross_rank_deadlock():
    # rank 0 waits for the gradient of mb 0 before sending F1; rank 1 needs F1 before BW0.
    F, BW = "F", "BW"
    rows = [
        [Action(F, 0, 0), Action(BW, 0, 0), Action(F, 1, 0), Action(BW, 1, 0)],
        [Action(F, 0, 1), Action(F, 1, 1), Action(BW, 0, 1), Action(BW, 1, 1)],
    ]
    s = Schedule(name="broken", p=2, m=2, v=1, num_stages=2, placement=linear_placement(2),
                 mb_pipe=[0, 0], actions=rows, split_backward=False)
    with pytest.raises(ScheduleError, match=r"deadlock.*rank 0 at BW0s0 waits for BW0s1 \(rank 1\)"):
        validate(s)
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(s)


def test_validator_rejects_broken_overlapped_pairs():
    good = make_schedule("dualpipe", 4, 8)
    f, b = good.overlapped[0]
    s = dataclasses.replace(good, overlapped=[(b, f)])
    with pytest.raises(ScheduleError, match="must be a forward and a backward"):
        validate(s)
    far = next(a for a in good.actions[good.rank_of(f)] if a.kind == "BW" and a != b)
    s = dataclasses.replace(good, overlapped=[(f, far)])
    with pytest.raises(ScheduleError, match="is not adjacent on one rank"):
        validate(s)


@PROFILE
@given(shapes, st.integers(0, 10_000), st.sampled_from(["drop", "duplicate"]))
def test_validator_catches_random_drops_and_duplicates(shape, seed, mutation):
    name, p, m, v = shape
    assume(supported(name, p, m, v))
    s = _copy(make_schedule(name, p, m, v))
    rng = random.Random(seed)
    rank = rng.choice([r for r in range(p) if s.actions[r]])
    victim = rng.choice(s.actions[rank])
    if mutation == "drop":
        s.actions[rank].remove(victim)
        expected = "missing"
    else:
        s.actions[rank].insert(rng.randrange(len(s.actions[rank]) + 1), victim)
        expected = "duplicate"
    with pytest.raises(ScheduleError, match=expected):
        validate(s)


@PROFILE
@given(shapes, st.integers(0, 10_000))
def test_validator_and_simulator_agree_on_shuffled_orders(shape, seed):
    """Shuffle one rank's list: either both accept it or the validator explains why not."""
    name, p, m, v = shape
    assume(supported(name, p, m, v))
    s = _copy(make_schedule(name, p, m, v), overlapped=[])
    rng = random.Random(seed)
    rank = rng.randrange(p)
    rng.shuffle(s.actions[rank])
    try:
        validate(s)
    except ScheduleError as err:
        assert "later at position" in str(err) or "deadlock" in str(err)
        if "deadlock" in str(err):
            with pytest.raises(ScheduleError, match="deadlock"):
                simulate(s)
    else:
        sim = simulate(s)
        assert sim.makespan >= max(sim.busy)
