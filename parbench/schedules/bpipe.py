"""BPipe: the 1F1B order plus activation evictions between paired stages.

Kim, Kim, Yu, Chun 2023, "BPipe: Memory-Balanced Pipeline Parallelism for Training Large
Language Models" (ICML 2023), Sec. 3: under 1F1B stage x keeps up to p - x micro-batches'
activations, so the first stages run out of memory first. BPipe pairs stage x < p/2 (the
*evictor*) with stage p-1-x (the *acceptor*, which keeps only x + 1 of its own): after a
forward the evictor may send the activations it just saved to its partner and free them
("evict"), and receive them back before that micro-batch's backward ("load"); when it has
to evict, it evicts the latest micro-batch among those it holds, which stays away longest
and so needs the fewest transfers.

Here (``eviction_plan``):

* **how many**: every stage keeps at most ``threshold(p) = ceil((p+2)/2)`` micro-batches'
  activations resident while it computes (BPipe's balanced per-stage bound, against p for
  1F1B's first stage; counted with the micro-batch the current action works on -- a forward
  builds its activations before they can be evicted, a backward needs them loaded. The
  pair's p + 1 micro-batches split about evenly, one slot more for the one in transit).
  Forwards are decided in order; a micro-batch is kept when keeping it to its backward never
  exceeds the threshold at any action of the row (earlier decisions fixed), and evicted
  otherwise: the latest is the one evicted. The count has a closed form
  (``parbench.analytic.pipeline_bpipe``): on an evictor with warm-up w = p-1-x and
  d = p-x-threshold > 0, the latest d micro-batches of every block of w consecutive ones;
  the unit tests pin the two against each other.
* **when** (the paper overlaps transfers with compute; the positions below are where this
  executor posts and waits, chosen so that nothing deadlocks and the partner's post comes,
  in the unit-cost simulation, no later than the wait): the evictor posts the eviction right
  after F(j) and frees the storages at the start of its next action, once the send is done;
  it loads j at the start of BW(j). The acceptor posts the receive before its first action
  that starts, in the unit-cost simulation, once the evictor's F(j) has ended, returns j
  before its first action that starts once the evictor's action before BW(j) has started,
  and releases the buffer when that send is done, before its first action that starts once
  the evictor's BW(j) has.
  ``check_plan`` proves the plan free of deadlock (every blocking wait's partner post is
  reached without the waiter passing that wait).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .actions import BACKWARD_FULL, FORWARD, Action, Schedule, ScheduleError
from .basic import flush_closed_form, one_f_one_b_rows
from .closed_forms import one_f_one_b_max_inflight
from .spec import ChunkRule, ExecutorKind, Placement, Rows, schedule_spec

#: pair operations: the evictor's (evict: post the send after F; free: wait for it and drop
#: the storages; load: receive before BW) and the acceptor's (accept: post the receive;
#: give_back: wait for it and send it back; release: wait for that send and drop the buffer)
EVICT, FREE, LOAD = "evict", "free", "load"
ACCEPT, GIVE_BACK, RELEASE = "accept", "give_back", "release"
PAIR_OPS = (EVICT, FREE, LOAD, ACCEPT, GIVE_BACK, RELEASE)
#: order at one position: the evictor frees before it loads (so an eviction and a load at
#: one action never overlap there); the acceptor accepts before it releases (the evictor's
#: free there waits for the accept)
_ORDER = {ACCEPT: 0, GIVE_BACK: 1, RELEASE: 2, FREE: 0, LOAD: 1, EVICT: 0}


def threshold(p: int) -> int:
    """Micro-batches' activations a stage keeps resident at most: ceil((p+2)/2)."""
    return (p + 3) // 2


def partner(p: int, rank: int) -> int:
    """The paired stage p-1-rank (a stage of odd p's middle is its own partner)."""
    return p - 1 - rank


@schedule_spec(
    "bpipe",
    description="BPipe (Kim et al. 2023): 1F1B with activations evicted from stage x to "
                "stage p-1-x and loaded back before the backward",
    chunks=ChunkRule.ONE, placement=Placement.LINEAR, executor=ExecutorKind.BPIPE,
    closed_form=flush_closed_form, max_inflight=one_f_one_b_max_inflight,
    memory=lambda p, m, v, rank: min(m, p, threshold(p)),
    memory_note="at most ceil((p+2)/2) micro-batches of activations resident on any stage, "
                "against 1F1B's p on the first (Kim et al. 2023, Sec. 3); priced with the "
                "evictions overlapped with compute, as the paper runs them")
def bpipe(p: int, m: int, v: int) -> Rows:
    """BPipe's compute order is 1F1B's (fused backwards: BPipe loads the activations before
    the backward); the evictions are ``eviction_plan(schedule)``."""
    return Rows(one_f_one_b_rows(p, m),
                notes=f"activations evicted to the paired stage above "
                      f"ceil((p+2)/2)={threshold(p)} resident micro-batches")


@dataclass(frozen=True)
class PairOp:
    """One pair operation on one rank: ``kind`` for micro-batch ``mb`` with rank ``peer``,
    done at the ``when`` ("start" or "end") of the action at position ``at`` of the rank's
    row (``at == len(row)``, "start": after the last action)."""

    kind: str
    mb: int
    peer: int
    at: int
    when: str = "start"


@dataclass
class EvictionPlan:
    """Which micro-batches each evictor sends away, and every rank's pair operations."""

    p: int
    m: int
    threshold: int
    evicted: dict[int, list[int]] = field(default_factory=dict)
    ops: list[list[PairOp]] = field(default_factory=list)

    def ops_at(self, rank: int, at: int, when: str) -> list[PairOp]:
        return [o for o in self.ops[rank] if o.at == at and o.when == when]

    def resident(self, schedule: Schedule, rank: int) -> list[int]:
        """Micro-batches resident on ``rank``'s own row at each action (the plan's count)."""
        return _resident(schedule.actions[rank], set(self.evicted.get(rank, ())))


def _resident(row: list[Action], evicted: set[int]) -> list[int]:
    pos = {(a.kind, a.mb): i for i, a in enumerate(row)}
    count = [1] * len(row)
    for mb in {a.mb for a in row}:
        if mb not in evicted:
            for t in range(pos[(FORWARD, mb)] + 1, pos[(BACKWARD_FULL, mb)]):
                count[t] += 1
    return count


def evicted_microbatches(row: list[Action], limit: int) -> list[int]:
    """Greedy in forward order: keep a micro-batch unless keeping it to its backward would
    put more than ``limit`` resident at some action; otherwise evict it (the latest)."""
    pos = {(a.kind, a.mb): i for i, a in enumerate(row)}
    count = [1] * len(row)
    out = []
    for a in row:
        if a.kind != FORWARD:
            continue
        span = range(pos[(FORWARD, a.mb)] + 1, pos[(BACKWARD_FULL, a.mb)])
        if all(count[t] < limit for t in span):
            for t in span:
                count[t] += 1
        else:
            out.append(a.mb)
    return out


def _first_starting(row, times, t: float) -> int:
    """Index of the first action of ``row`` starting at or after time ``t`` (len: none)."""
    for i, a in enumerate(row):
        if times[a][0] >= t - 1e-9:
            return i
    return len(row)


def eviction_plan(schedule: Schedule, limit: int | None = None,
                  choose=None) -> EvictionPlan:
    """The evictions of a BPipe (1F1B) schedule and where every pair operation happens;
    ``choose(row, limit)`` picks an evictor's evicted micro-batches (default
    ``evicted_microbatches``)."""
    choose = evicted_microbatches if choose is None else choose
    from .simulate import simulate
    p, m = schedule.p, schedule.m
    limit = threshold(p) if limit is None else limit
    if limit < 2:
        raise ScheduleError(f"bpipe: threshold={limit} must be at least 2 (a backward needs "
                            "its micro-batch loaded while the next forward may be resident)")
    times = simulate(schedule).times
    plan = EvictionPlan(p, m, limit, ops=[[] for _ in range(p)])
    for x in range(p // 2):
        a_rank = partner(p, x)
        row, arow = schedule.actions[x], schedule.actions[a_rank]
        pos = {(a.kind, a.mb): i for i, a in enumerate(row)}
        evicted = choose(row, limit)
        if evicted:
            plan.evicted[x] = evicted
        for j in evicted:
            f, b = pos[(FORWARD, j)], pos[(BACKWARD_FULL, j)]
            plan.ops[x] += [PairOp(EVICT, j, a_rank, f, "end"), PairOp(FREE, j, a_rank, f + 1),
                            PairOp(LOAD, j, a_rank, b)]
            accept = _first_starting(arow, times, times[row[f]][1])
            give = max(accept, _first_starting(arow, times, times[row[b - 1]][0]))
            release = max(give + 1, _first_starting(arow, times, times[row[b]][0]))
            release = min(release, len(arow))
            plan.ops[a_rank] += [PairOp(ACCEPT, j, x, accept), PairOp(GIVE_BACK, j, x, give),
                                 PairOp(RELEASE, j, x, release)]
    for ops in plan.ops:
        ops.sort(key=lambda o: (o.at, o.when == "end", _ORDER[o.kind], o.mb))
    check_plan(schedule, plan)
    return plan


def check_plan(schedule: Schedule, plan: EvictionPlan) -> None:
    """Raise ScheduleError if a blocking wait of the plan can deadlock.

    Each rank is one sequence of events: at every position its "start" pair operations in
    order, the action, its "end" operations (and after the last action the step end's). An
    event follows the one before it on its rank; an action also follows the actions it needs;
    a wait (free, load, give_back, release) also follows the partner's matching post. The
    plan is free of deadlock when this graph has no cycle.
    """
    kinds = schedule.backward_kinds()
    deps: dict[tuple, list] = {}
    where: dict[tuple, tuple] = {}
    for r, row in enumerate(schedule.actions):
        prev = None
        for i in range(len(row) + 1):
            events = [("op", o) for o in plan.ops_at(r, i, "start")]
            if i < len(row):
                events += [("act", row[i])] + [("op", o) for o in plan.ops_at(r, i, "end")]
            for ev in events:
                node = (r, ev)
                deps[node] = [prev] if prev is not None else []
                where[ev] = node
                prev = node
    for r, row in enumerate(schedule.actions):
        for a in row:
            deps[(r, ("act", a))] += [where[("act", d)] for d in schedule.dependencies(a, kinds)]
    posts = {(o.kind, o.mb, r): where[("op", o)] for r, ops in enumerate(plan.ops) for o in ops}
    for r, ops in enumerate(plan.ops):
        for o in ops:
            if o.kind == FREE:  # the evictor's send completes once the acceptor posted
                deps[where[("op", o)]].append(posts[(ACCEPT, o.mb, o.peer)])
            elif o.kind == RELEASE:  # the acceptor's send completes once the load is posted
                deps[where[("op", o)]].append(posts[(LOAD, o.mb, o.peer)])
            elif o.kind in (LOAD, GIVE_BACK):  # a receive completes once the send is posted
                sender = GIVE_BACK if o.kind == LOAD else EVICT
                deps[where[("op", o)]].append(posts[(sender, o.mb, o.peer)])
    indegree = {n: len(ds) for n, ds in deps.items()}
    users: dict[tuple, list] = {n: [] for n in deps}
    for n, ds in deps.items():
        for d in ds:
            users[d].append(n)
    ready = deque(n for n, k in indegree.items() if k == 0)
    seen = 0
    while ready:
        n = ready.popleft()
        seen += 1
        for u in users[n]:
            indegree[u] -= 1
            if indegree[u] == 0:
                ready.append(u)
    if seen != len(deps):
        stuck = sorted(str(n[1][1]) for n, k in indegree.items() if k)[:4]
        raise ScheduleError(f"bpipe (p={plan.p}, m={plan.m}): the eviction plan can deadlock; "
                            f"{', '.join(stuck)} never happen")
