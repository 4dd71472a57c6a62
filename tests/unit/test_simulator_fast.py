"""The fast simulator and validator against the ones they replaced (issue 12, item 5).

The reference below is the simulator as it stood before the rewrite (``run_times``,
``_peaks`` and ``simulate``'s bookkeeping, kept verbatim but for names), and the validator
as the sequence of its unchanged ``_check_*`` functions followed by the reference
``run_times``.  It lives here, in the test tree, rather than as a second simulator in the
package: nothing but these tests should call it, and keeping it frozen is the point.
``make_cost`` and ``_deadlock_message`` are shared: the rewrite left their behaviour alone
(``make_cost`` only marks its function as depending on kind and stage, which the reference
ignores, asking it action by action).

Equality here is exact: every float compared bit for bit (a -0.0 is not a 0.0), ``times``
and ``idle`` in the same order, errors with the same type and message.  Speed targets live
in ``scripts/bench_simulator.py``; the large cases below only check that they run.
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import itertools
import math
import random
from collections import deque
from numbers import Real

import numpy as np
import pytest

from parbench.schedules import (
    SCHEDULES,
    Action,
    Schedule,
    ScheduleError,
    SimResult,
    closed_form,
    make_schedule,
    simulate,
    steady_step,
    validate,
)
from parbench.schedules.actions import (
    BACKWARD_FULL,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    linear_placement,
)

sim_module = importlib.import_module("parbench.schedules.simulate")
val_module = importlib.import_module("parbench.schedules.validate")
make_cost = sim_module.make_cost


# -- the reference: the simulator before the rewrite ----------------------------------
def reference_run_times(schedule, cost, p2p=0.0, overlap=False, tfb=None):
    kinds = schedule.backward_kinds()
    partner = dict(schedule.overlapped) if overlap else {}
    rank_of = {}
    for rank, _, a in schedule.iter_actions():
        rank_of.setdefault(a, rank)
    pos = [0] * schedule.p
    free = [0.0] * schedule.p
    times = {}
    avail = {a: 0.0 for a in schedule.done_before}
    waiting = {}
    ready = deque(range(schedule.p))
    while ready:
        rank = ready.popleft()
        row = schedule.actions[rank]
        while pos[rank] < len(row):
            group = [row[pos[rank]]]
            mate = partner.get(group[0])
            if mate is not None and pos[rank] + 1 < len(row) and row[pos[rank] + 1] == mate:
                group.append(mate)
            start = free[rank]
            blocked = None
            for action in group:
                for dep in schedule.dependencies(action, kinds):
                    if dep in group:
                        continue
                    done = avail.get(dep)
                    if done is None:
                        blocked = dep
                        break
                    lag = p2p if rank_of.get(dep, rank) != rank else 0.0
                    start = max(start, done + lag)
                if blocked is not None:
                    break
            if blocked is not None:
                waiting.setdefault(blocked, []).append(rank)
                break
            costs = [float(cost(a)) for a in group]
            for a, c in zip(group, costs):
                if c < 0:
                    raise ScheduleError(f"cost of {a} must be >= 0 (got {c})")
            if len(group) == 1:
                duration = costs[0]
            elif tfb is None:
                duration = sum(costs)
            elif callable(tfb):
                duration = float(tfb(*group))
            else:
                duration = float(tfb)
            total, cursor = sum(costs), start
            for a, c in zip(group, costs):
                share = duration * (c / total if total > 0 else 1 / len(group))
                times[a] = (cursor, cursor + share)
                cursor += share
            end = start + duration
            free[rank] = end
            pos[rank] += len(group)
            for a in group:
                avail[a] = end
                ready.extend(waiting.pop(a, ()))
    stuck = [r for r in range(schedule.p) if pos[r] < len(schedule.actions[r])]
    if stuck:
        raise ScheduleError(sim_module._deadlock_message(schedule, pos, stuck, kinds, rank_of))
    return times


def reference_peaks(row, times):
    events = []
    forwards = {(a.mb, a.stage, a.pipe) for a in row if a.kind == FORWARD}
    carried_i = {(a.mb, a.stage, a.pipe) for a in row if a.kind in (BACKWARD_FULL,
                                                                     BACKWARD_INPUT)}
    carried_h = {(a.mb, a.stage, a.pipe) for a in row if a.kind in (BACKWARD_FULL,
                                                                     BACKWARD_WEIGHT)}
    for a in row:
        start, end = times[a]
        if a.kind == FORWARD:
            events.append((start, 1, 1, 0, 1))
        elif a.kind == BACKWARD_FULL:
            events.append((end, 0, -1, 0, -1))
        elif a.kind == BACKWARD_INPUT:
            events.append((end, 0, -1, 1, 0))
        elif a.kind == BACKWARD_WEIGHT:
            events.append((end, 0, 0, -1, -1))
    inflight, held = len(carried_i - forwards), len(carried_h - forwards)
    pending, peak_i, peak_w, peak_h = 0, inflight, 0, held
    for _, _, di, dw, dh in sorted(events):
        inflight += di
        pending += dw
        held += dh
        peak_i = max(peak_i, inflight)
        peak_w = max(peak_w, pending)
        peak_h = max(peak_h, held)
    return peak_i, peak_w, peak_h


def reference_simulate(schedule, tf=1.0, tb=1.0, tw=1.0, p2p=0.0, tbw=None, cost=None,
                       costs=None, overlap=False, tfb=None):
    cost_fn = make_cost(tf, tb, tw, tbw, cost, costs)
    times = reference_run_times(schedule, lambda a: cost_fn(a), p2p, overlap, tfb)
    p = schedule.p
    makespan = max((end for _, end in times.values()), default=0.0)
    busy, idle, span, peak_i, peak_w, peak_h = [], [], [], [], [], []
    for rank in range(p):
        row = schedule.actions[rank]
        busy.append(sum(times[a][1] - times[a][0] for a in row))
        gaps, cursor = [], 0.0
        for a in row:
            start, end = times[a]
            if start > cursor:
                gaps.append((cursor, start))
            cursor = max(cursor, end)
        if makespan > cursor:
            gaps.append((cursor, makespan))
        idle.append(gaps)
        span.append(times[row[-1]][1] - times[row[0]][0] if row else 0.0)
        for peaks, value in zip((peak_i, peak_w, peak_h), reference_peaks(row, times)):
            peaks.append(value)
    if makespan > 0:
        bubble = 1.0 - sum(busy) / (p * makespan)
        per_rank = [1.0 - b / makespan for b in busy]
    else:
        bubble, per_rank = 0.0, [0.0] * p
    params = {"tf": tf, "tb": tb, "tw": tw, "tbw": tbw, "p2p": p2p, "overlap": overlap, "tfb": tfb}
    params = {k: val for k, val in params.items() if val is None or isinstance(val, (Real, bool))}
    if cost is not None or costs is not None:
        params["custom_costs"] = True
    return SimResult(schedule, makespan, busy, bubble, per_rank, peak_i, peak_w, times, idle,
                     span, params, peak_h)


def reference_validate(schedule):
    """The validator before the rewrite: its checks (unchanged code) and the reference runs."""
    if schedule.done_before:
        val_module._fail(schedule, "a window of a longer run (done_before is set) is not a "
                                   "whole schedule; validate the run it was cut from")
    for check in ("shape", "actions", "coverage", "order", "overlapped", "transfers"):
        getattr(val_module, f"_check_{check}")(schedule)
    reference_run_times(schedule, make_cost(1.0, 1.0, 1.0))
    if schedule.overlapped:
        reference_run_times(schedule, make_cost(1.0, 1.0, 1.0), overlap=True)
    return schedule


# -- exact comparison -------------------------------------------------------------------
def same(x, y) -> bool:
    """Equal to the bit: floats by value and sign (NaN equals NaN), containers item by item
    and in order, types alike."""
    if type(x) is not type(y):
        return False
    if isinstance(x, float):
        return (x == y and math.copysign(1, x) == math.copysign(1, y)) or (x != x and y != y)
    if isinstance(x, (list, tuple)):
        return len(x) == len(y) and all(same(a, b) for a, b in zip(x, y))
    if isinstance(x, dict):
        return list(x) == list(y) and all(same(x[k], y[k]) for k in x)
    return x == y


RESULT_FIELDS = [f.name for f in dataclasses.fields(SimResult) if f.name != "schedule"]


def outcome(fn, *args, **kw):
    """What `fn` returns, or ``(type, message)`` of what it raises."""
    try:
        return fn(*args, **kw)
    except Exception as err:  # noqa: BLE001 -- the two sides must fail alike
        return (type(err), str(err))


def assert_same_simulation(schedule, **kw):
    ref, new = outcome(reference_simulate, schedule, **kw), outcome(simulate, schedule, **kw)
    if isinstance(ref, tuple) or isinstance(new, tuple):
        assert ref == new, (schedule.name, kw)
        return
    for name in RESULT_FIELDS:
        assert same(getattr(ref, name), getattr(new, name)), (schedule.name, kw, name)
    assert new.schedule is schedule


def assert_same_validation(schedule):
    ref, new = outcome(reference_validate, schedule), outcome(validate, schedule)
    assert ref == new if isinstance(ref, tuple) else new is schedule, (ref, new)


# -- every registered schedule, small shapes, every cost setting -------------------------
def cost_settings(schedule):
    S = schedule.num_stages
    yield {}
    yield {"tf": 1.0, "tb": 2.0, "tw": 0.5}
    yield {"tf": 0.3, "tb": 0.7, "tw": 0.1, "p2p": 0.25}
    yield {"tf": 1, "tb": 3, "tw": 0, "p2p": 1}  # ints, zero-cost W, an int latency
    yield {"tf": [1 + 0.1 * s for s in range(S)], "tb": {s: 1.5 - 0.05 * s for s in range(S)},
           "tw": 0.25, "tbw": 1.7}
    yield {"cost": lambda a: 0.5 + 0.1 * a.stage + (a.mb % 3) * 0.25, "p2p": 0.05}
    yield {"costs": {a: 2.5 for a in schedule.actions[0][::3]}, "tf": 0.0}
    yield {"overlap": True}
    yield {"overlap": True, "tfb": 2.0, "p2p": 0.1}
    yield {"overlap": True, "tfb": lambda f, b: 1.25, "tf": 2.0, "tb": 1.0, "tw": 0.0}


def small_shapes():
    for name in SCHEDULES:
        for p, m, v in itertools.product([1, 2, 3, 4], [1, 2, 3, 5, 8], [None, 2, 3]):
            try:
                yield make_schedule(name, p, m, v)
            except ScheduleError:
                continue


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_schedule_simulates_exactly_as_before(name):
    shapes = [s for s in small_shapes() if s.name == name]
    assert shapes
    for schedule in shapes:
        for kw in cost_settings(schedule):
            assert_same_simulation(schedule, **kw)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_schedule_validates_exactly_as_before(name):
    for schedule in (s for s in small_shapes() if s.name == name):
        assert_same_validation(schedule)


def test_run_times_keeps_the_order_actions_ran_in():
    """``run_times``' dict lists the actions as they finished (Chimera's generator reads it)."""
    for name in ("1f1b", "interleaved", "chimera", "dualpipe"):
        schedule = make_schedule(name, 4, 8)
        for kw in ({}, {"overlap": True, "p2p": 0.5}):
            ref = reference_run_times(schedule, make_cost(1, 1, 0), **kw)
            assert same(sim_module.run_times(schedule, make_cost(1, 1, 0), **kw), ref)


# -- schedules the generators never make --------------------------------------------------
def _mutants(seed: int, count: int):
    """Broken copies of small schedules: dropped, repeated, moved and shuffled actions, odd
    fields (out of range, float, bool, unknown kind), flipped flags and broken pairs."""
    rng = random.Random(seed)
    bases = [make_schedule(n, p, m) for n, p, m in [("1f1b", 3, 4), ("zb-h1", 3, 4),
             ("interleaved", 2, 4), ("zbv", 2, 4), ("chimera", 2, 4), ("dualpipe", 4, 8),
             ("dualpipev", 2, 4), ("gpipe", 2, 3)]]
    while count:
        s = rng.choice(bases)
        rows = [list(r) for r in s.actions]
        r = rng.randrange(len(rows))
        i = rng.randrange(len(rows[r]))
        a, changes = rows[r][i], {}
        how = rng.randrange(14)
        if how == 0:
            rows[r].pop(i)
        elif how == 1:
            rows[r].insert(rng.randrange(len(rows[r]) + 1), a)
        elif how == 2:
            rng.shuffle(rows[r])
        elif how == 3:
            j = rng.randrange(len(rows[r]))
            rows[r][i], rows[r][j] = rows[r][j], rows[r][i]
        elif how == 4:
            rows[r][i] = dataclasses.replace(a, mb=a.mb + rng.choice([s.m, 100]))
        elif how == 5:
            rows[r][i] = dataclasses.replace(a, kind=rng.choice(["F", "B", "W", "BW", "X"]))
        elif how == 6:
            rows[r][i] = dataclasses.replace(a, pipe=1 - a.pipe)
        elif how == 7:
            rows[(r + 1) % len(rows)].append(rows[r].pop(i))
        elif how == 8:
            rows[r][i] = dataclasses.replace(a, stage=a.stage + rng.choice([-1, 1, 50]))
        elif how == 9:
            changes["split_backward"] = not s.split_backward
        elif how == 10 and s.overlapped:
            pairs = list(s.overlapped)
            k = rng.randrange(len(pairs))
            f, b = pairs[k]
            pairs[k] = rng.choice([(b, f), (f, a), (a, b), (f, dataclasses.replace(b, mb=99))])
            changes["overlapped"] = pairs
        elif how == 11:
            rows[r][i] = dataclasses.replace(a, mb=rng.choice([float(a.mb), bool(a.mb % 2)]))
        elif how == 12:
            changes["num_stages"] = s.num_stages + rng.choice([-1, 1])
        elif how == 13:  # numbers of other types where the schedule has ints
            field = rng.choice(["m", "mb_pipe", "placement"])
            changes[field] = {"m": float(s.m), "mb_pipe": [bool(x) for x in s.mb_pipe],
                              "placement": {k: np.int64(r) for k, r in s.placement.items()}
                              }[field]
        yield dataclasses.replace(s, actions=rows, **changes)
        count -= 1


@pytest.mark.parametrize("seed", range(4))
def test_broken_schedules_fail_or_pass_exactly_as_before(seed):
    for s in _mutants(seed, 150):
        assert_same_validation(s)
        assert_same_simulation(s)
        assert_same_simulation(s, tf=1.0, tb=2.0, tw=0.5, p2p=0.5, overlap=True)


def test_odd_costs_and_windows_simulate_exactly_as_before():
    one = make_schedule("1f1b", 3, 4)
    odd = [{"tf": 0.0, "tb": 0.0, "tw": 0.0}, {"tf": math.inf}, {"tb": math.nan},
           {"costs": {Action("F", 1, 1): -1.0}}, {"tf": [1.0]}, {"tf": "x"},
           {"cost": lambda a: {"F": 1.0}[a.kind]}, {"p2p": -0.0, "tf": 0.0},
           {"tbw": 0.0, "tf": -0.0}, {"p2p": np.float64(0.5)}, {"tf": np.float32(1.5)},
           {"cost": lambda a: np.float64(a.stage + 1), "p2p": 0.25}]
    for kw in odd:
        assert_same_simulation(one, **kw)
    dual = make_schedule("dualpipe", 4, 8)
    for kw in ({"overlap": True, "tfb": 0.0}, {"overlap": True, "tfb": -1.0},
               {"overlap": True, "tf": 0.0, "tb": 0.0, "tw": 0.0},
               {"overlap": True, "tfb": lambda f, b: math.inf}):
        assert_same_simulation(dual, **kw)
    for name, p, m in [("pipedream", 3, 4), ("2bw", 4, 2), ("pipedream", 2, 1)]:
        window = steady_step(name, p, m)  # done_before: the step before
        for kw in cost_settings(window):
            assert_same_simulation(window, **kw)
        assert_same_validation(window)


def test_a_deadlock_is_named_as_before():
    rows = [[Action(FORWARD, 0, 0), Action(BACKWARD_FULL, 0, 0), Action(FORWARD, 1, 0),
             Action(BACKWARD_FULL, 1, 0)],
            [Action(FORWARD, 0, 1), Action(FORWARD, 1, 1), Action(BACKWARD_FULL, 0, 1),
             Action(BACKWARD_FULL, 1, 1)]]
    s = Schedule(name="broken", p=2, m=2, v=1, num_stages=2, placement=linear_placement(2),
                 mb_pipe=[0, 0], actions=rows, split_backward=False)
    assert_same_validation(s)
    assert_same_simulation(s)
    missing = dataclasses.replace(s, actions=[rows[0][:1], rows[1][:1] + [Action("B", 0, 1)]])
    assert_same_simulation(missing)


# -- the data types ------------------------------------------------------------------------
def test_action_init_is_the_dataclass_one():
    """`Action` writes its own __init__ (for speed); it must take and store what the
    dataclass one would."""
    names = [f.name for f in dataclasses.fields(Action)]
    params = inspect.signature(Action).parameters
    assert list(params) == names and params["pipe"].default == 0
    assert [p.default for p in params.values()][:3] == [inspect.Parameter.empty] * 3
    a = Action("BW", 3, 5, 1)
    assert dataclasses.astuple(a) == ("BW", 3, 5, 1) and hash(a) == hash(("BW", 3, 5, 1))
    assert Action(kind="F", mb=1, stage=2) == Action("F", 1, 2, 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.mb = 4


# -- large cases: they run (their speed is scripts/bench_simulator.py's business) -----------
@pytest.mark.parametrize("name,p,m,v", [("1f1b", 64, 1024, None), ("interleaved", 64, 512, 4)])
def test_large_schedules_run(name, p, m, v):
    schedule = validate(make_schedule(name, p, m, v))
    sim = simulate(schedule)
    assert sim.bubble == pytest.approx(closed_form(schedule).bubble_ratio)
    assert len(sim.times) == schedule.num_actions()
