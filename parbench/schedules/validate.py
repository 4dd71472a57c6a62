"""The one validator every schedule goes through.

`validate(schedule)` checks, in order, and raises `ScheduleError` with a precise
message at the first problem:

1. shape: p, m, v, num_stages, placement and mb_pipe agree with each other;
2. every action is well formed (known kind, mb and stage in range, pipe equal to
   the micro-batch's pipe) and sits on the rank `placement` says;
3. coverage: every (mb, stage) of the micro-batch's pipe has exactly one F and
   either exactly one BW or exactly one B and one W — nothing missing, nothing
   duplicated, no B/W in a schedule that says `split_backward=False`;
4. order within a rank: a dependency on the same rank comes earlier in the list;
5. overlapped pairs (if any) are a forward and a backward adjacent on one rank;
6. transfers: every transfer from :meth:`Schedule.comm` joins a producer on its
   source rank to a consumer on its destination rank, and each boundary carries
   exactly one activation and one gradient per micro-batch;
7. no deadlock: the dependency-driven simulation runs to completion (also with
   overlapped pairs run as units).

Checks 2 to 6 first run as whole-array tests on the numbered schedule (`plan_form._Plan`);
only a schedule one of them doubts goes through the action-by-action check, which names
its first problem.  Check 7 runs the worklist without the times (`simulate._deadlock_free`)
and, on a stall, the simulation itself for its message.
"""
from __future__ import annotations

from collections import Counter

import numpy as np

from .actions import (
    BACKWARD_FULL,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    KINDS,
    Action,
    Schedule,
    ScheduleError,
)
from .simulate import _deadlock_free, _Plan, _run, make_cost


def _fail(schedule: Schedule, message: str) -> None:
    raise ScheduleError(f"{schedule.name} (p={schedule.p}, m={schedule.m}): {message}")


def _check_shape(s: Schedule) -> None:
    if len(s.actions) != s.p:
        _fail(s, f"actions has {len(s.actions)} rank lists, expected p={s.p}")
    if len(s.mb_pipe) != s.m:
        _fail(s, f"mb_pipe has {len(s.mb_pipe)} entries, expected m={s.m}")
    if s.segments < 1 or s.m % s.segments:
        _fail(s, f"m={s.m} units is not a whole number of micro-batches of "
                 f"segments={s.segments} token slices")
    pipes = sorted({pipe for pipe, _ in s.placement})
    for pipe in pipes:
        stages = sorted(stage for q, stage in s.placement if q == pipe)
        if stages != list(range(s.num_stages)):
            _fail(s, f"placement of pipe {pipe} covers stages {stages}, expected 0..{s.num_stages - 1}")
    for key, rank in s.placement.items():
        if not 0 <= rank < s.p:
            _fail(s, f"placement {key} -> rank {rank} is outside 0..{s.p - 1}")
    for mb, pipe in enumerate(s.mb_pipe):
        if pipe not in pipes:
            _fail(s, f"mb_pipe[{mb}]={pipe} is not a pipe of the placement {pipes}")


def _check_actions(s: Schedule) -> None:
    for rank, pos, a in s.iter_actions():
        where = f"rank {rank} position {pos} ({a})"
        if a.kind not in KINDS:
            _fail(s, f"{where}: unknown kind {a.kind!r} (known: {', '.join(KINDS)})")
        if not 0 <= a.mb < s.m:
            _fail(s, f"{where}: mb={a.mb} is outside 0..{s.m - 1}")
        if not 0 <= a.stage < s.num_stages:
            _fail(s, f"{where}: stage={a.stage} is outside 0..{s.num_stages - 1}")
        if a.pipe != s.mb_pipe[a.mb]:
            _fail(s, f"{where}: pipe={a.pipe} but micro-batch {a.mb} uses pipe {s.mb_pipe[a.mb]}")
        home = s.placement.get((a.pipe, a.stage))
        if home != rank:
            _fail(s, f"{where}: stage {a.stage} of pipe {a.pipe} lives on rank {home}")
        if not s.split_backward and a.kind in (BACKWARD_INPUT, BACKWARD_WEIGHT):
            _fail(s, f"{where}: {a.kind} in a schedule with split_backward=False")


def _check_coverage(s: Schedule) -> None:
    counts = Counter(a for _, _, a in s.iter_actions())
    for action, n in counts.items():
        if n > 1:
            _fail(s, f"duplicate {action} ({n} times)")
    for mb in range(s.m):
        pipe = s.mb_pipe[mb]
        for stage in range(s.num_stages):
            found = {k for k in KINDS if Action(k, mb, stage, pipe) in counts}
            where = f"mb={mb} stage={stage} pipe={pipe}"
            if FORWARD not in found:
                _fail(s, f"missing F for {where}")
            if BACKWARD_FULL in found:
                if found & {BACKWARD_INPUT, BACKWARD_WEIGHT}:
                    _fail(s, f"{where} has both BW and B/W")
                continue
            for k in (BACKWARD_INPUT, BACKWARD_WEIGHT):
                if k not in found:
                    _fail(s, f"missing {k} for {where} (needs BW, or B and W)")


def _check_order(s: Schedule) -> None:
    kinds = s.backward_kinds()
    for rank, row in enumerate(s.actions):
        position = {a: i for i, a in enumerate(row)}
        for i, a in enumerate(row):
            for dep in s.dependencies(a, kinds):
                j = position.get(dep)
                if j is not None and j > i:
                    _fail(s, f"rank {rank}: {a} at position {i} needs {dep}, "
                             f"which comes later at position {j} on the same rank")


def _check_overlapped(s: Schedule) -> None:
    position = {a: (r, i) for r, i, a in s.iter_actions()}
    for f, b in s.overlapped:
        if f.kind != FORWARD or b.kind not in (BACKWARD_INPUT, BACKWARD_FULL):
            _fail(s, f"overlapped pair ({f}, {b}) must be a forward and a backward-for-inputs")
        if f not in position or b not in position:
            _fail(s, f"overlapped pair ({f}, {b}) names an action that is not scheduled")
        (rf, i), (rb, j) = position[f], position[b]
        if rf != rb or j != i + 1:
            _fail(s, f"overlapped pair ({f}, {b}) is not adjacent on one rank "
                     f"(rank {rf} position {i}, rank {rb} position {j})")


def _check_transfers(s: Schedule) -> None:
    located = {a: r for r, _, a in s.iter_actions()}
    kinds = s.backward_kinds()
    per_boundary: Counter = Counter()
    for t in s.comm():
        if t.kind == "act":
            producer = Action(FORWARD, t.mb, t.src_stage, t.pipe)
            adjacent = t.dst_stage == t.src_stage + 1
        else:
            producer = Action(kinds.get((t.mb, t.src_stage, t.pipe), BACKWARD_FULL),
                              t.mb, t.src_stage, t.pipe)
            adjacent = t.dst_stage == t.src_stage - 1
        if not adjacent:
            _fail(s, f"transfer {t} does not join adjacent stages")
        if located.get(producer) != t.src_rank:
            _fail(s, f"transfer {t} has no producer {producer} on rank {t.src_rank}")
        per_boundary[(t.kind, t.mb, t.pipe, min(t.src_stage, t.dst_stage))] += 1
    for (kind, mb, pipe, stage), n in per_boundary.items():
        if n != 1:
            _fail(s, f"{kind} transfer of mb={mb} pipe={pipe} between stages {stage} and "
                     f"{stage + 1} appears {n} times, expected once")


# -- the same checks at numpy speed ------------------------------------------------
# Each says True only where its check above would pass; where it says False the check
# above runs and names the first problem (or passes: the quick ones may doubt wrongly).
# They read a regular `_Plan` (known kinds, non-negative int fields, nothing listed twice).
def _actions_ok(s: Schedule, plan: _Plan) -> bool:
    kind, mb, stage, pipe = (x[:plan.n] for x in plan.numbers)
    if not plan.n:
        return True
    mb_pipe = np.asarray(s.mb_pipe)
    if mb_pipe.dtype.kind != "i" or not (mb.max() < s.m and stage.max() < s.num_stages):
        return False
    if (mb_pipe[mb] != pipe).any():
        return False
    if not s.split_backward and ((kind == 1) | (kind == 2)).any():
        return False
    where = pipe * plan.S + stage
    home = np.full(int(where.max()) + 1, -1)
    for key in np.flatnonzero(np.bincount(where)).tolist():
        rank = s.placement.get(divmod(key, plan.S))
        if type(rank) is not int:
            return False
        home[key] = rank
    return not (home[where] != plan.rank).any()


def _coverage_ok(s: Schedule, plan: _Plan) -> bool:
    if type(s.m) is not int or type(s.num_stages) is not int:
        return False
    kind, mb, stage = (x[:plan.n] for x in plan.numbers[:3])
    cell = mb * s.num_stages + stage  # the pipe is the micro-batch's (`_check_actions`)
    f, b, w, bw = (np.bincount(cell[kind == k], minlength=s.m * s.num_stages)
                   for k in range(4))
    fused, split = (bw == 1) & (b == 0) & (w == 0), (bw == 0) & (b == 1) & (w == 1)
    return bool((f == 1).all() and (fused | split).all())


def _order_ok(plan: _Plan) -> bool:
    i = np.arange(plan.n)
    for d in plan.deps:
        later = (d > i) & (d < plan.n)
        if (plan.rank[d[later]] == plan.rank[later]).any():
            return False
    return True


def _overlapped_ok(s: Schedule, plan: _Plan) -> bool:
    codes = plan.codes_of([a for pair in s.overlapped for a in pair])
    for f, b in zip(codes[::2], codes[1::2]):
        if f is None or b is None or f % 4 != 0 or b % 4 not in (1, 3):
            return False
        i, j = int(plan.index[f]), int(plan.index[b])
        if not (0 <= i < plan.n and j == i + 1 and plan.rank[i] == plan.rank[j]):
            return False
    return True


def _transfers_ok(plan: _Plan) -> bool:
    """After the checks before it, every transfer joins a listed producer to its consumer,
    once per boundary, exactly when every dependency is listed."""
    return all(((d < plan.n) | (d == plan.NONE)).all() for d in plan.deps)


def validate(schedule: Schedule) -> Schedule:
    """Check `schedule` (see module docstring); return it unchanged if valid."""
    if schedule.done_before:
        _fail(schedule, "a window of a longer run (done_before is set) is not a whole "
                        "schedule; validate the run it was cut from")
    _check_shape(schedule)
    plan = _Plan(schedule)
    quick = plan.regular
    if not (quick and _actions_ok(schedule, plan)):
        _check_actions(schedule)
    if not (quick and _coverage_ok(schedule, plan)):
        _check_coverage(schedule)
    plan.link()
    if not (quick and _order_ok(plan)):
        _check_order(schedule)
    if schedule.overlapped and not (quick and _overlapped_ok(schedule, plan)):
        _check_overlapped(schedule)
    if not (quick and _transfers_ok(plan)):
        _check_transfers(schedule)
    plans = [plan]
    if schedule.overlapped:  # running the pairs as units must not deadlock either
        plans.append(_Plan(schedule).link(overlap=True))
    for plan in plans:
        if not _deadlock_free(plan):
            _run(plan, make_cost(1.0, 1.0, 1.0))  # raises the ScheduleError naming the waits
    return schedule


def fifo_violations(schedule: Schedule) -> list[str]:
    """Channels whose send order differs from the receive order.

    An executor that posts blocking sends and receives in list order needs, for
    every (src_rank, dst_rank, kind) channel, the sender's order of transfers to
    match the receiver's.  Executors that tag messages or use batched
    non-blocking p2p do not; the validator therefore does not require this, but
    reports it here.
    """
    order = {a: (r, i) for r, i, a in schedule.iter_actions()}
    kinds = schedule.backward_kinds()
    channels: dict[tuple, list] = {}
    for t in schedule.comm():
        if t.kind == "act":
            src = Action(FORWARD, t.mb, t.src_stage, t.pipe)
            dst = Action(FORWARD, t.mb, t.dst_stage, t.pipe)
        else:
            src = Action(kinds[(t.mb, t.src_stage, t.pipe)], t.mb, t.src_stage, t.pipe)
            dst = Action(kinds[(t.mb, t.dst_stage, t.pipe)], t.mb, t.dst_stage, t.pipe)
        channels.setdefault((t.src_rank, t.dst_rank), []).append((order[src][1], order[dst][1], t))
    bad = []
    for (src_rank, dst_rank), items in sorted(channels.items()):
        sends = [t for _, _, t in sorted(items, key=lambda x: x[0])]
        recvs = [t for _, _, t in sorted(items, key=lambda x: x[1])]
        if sends != recvs:
            bad.append(f"rank {src_rank} -> rank {dst_rank}: send order differs from receive order")
    return bad
