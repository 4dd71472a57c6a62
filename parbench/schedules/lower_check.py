"""The checks of a lowered schedule (``lower.p2p_problems``), without ranks.

* ``pair_orders``: every send has its receive and the reverse, once each, and for every
  ordered pair of ranks the receiver's order is the sender's (NCCL and gloo match a pair's
  messages by order);
* ``placement_problems``: a send follows the compute that produces its tensor, a receive
  precedes the compute that consumes it, and every cross-rank input has its receive;
* ``deadlock_free``: the lists run to the end under one of two models. Non-blocking posts
  (gloo with receives posted ahead): a batch is posted when its rank reaches it and never
  waits; a compute waits for the batch that sends its input to have been posted.
  Blocking (rendezvous) batches: a batch completes once the batch holding each of its
  operations' partners has been posted, and its rank waits for that -- NCCL once a message
  outgrows its buffers (a send then waits for its receive), with the executor synchronising
  the device after each compute. The lowering's order is the executor's, which passes this
  model for the 1F1B family but not for every schedule (interleaved, looped BFS, ZB-H2, ZB-V
  and DualPipe / DualPipeV exchange in both directions between two ranks before either
  receives); ``tests/unit/test_schedules_lower.py`` pins both facts.
"""
from __future__ import annotations

from collections import Counter, deque

from .actions import FORWARD, RECV_F, SEND_F, Action
from .lower import Lowered, batches, needed, peer_of, produced, transfer_key


def pair_orders(lowered: Lowered) -> list[str]:
    """Unmatched or duplicated messages, and pairs whose orders differ."""
    sched = lowered.schedule
    sends: dict[tuple[int, int], list] = {}
    recvs: dict[tuple[int, int], list] = {}
    for r, row in enumerate(lowered.actions):
        for a in row:
            if a.kind in (SEND_F, "SB"):
                sends.setdefault((r, peer_of(sched, a)), []).append(transfer_key(a))
            elif a.kind in (RECV_F, "RB"):
                recvs.setdefault((peer_of(sched, a), r), []).append(transfer_key(a))
    problems = []
    for pair in sorted(set(sends) | set(recvs)):
        out, got = sends.get(pair, []), recvs.get(pair, [])
        src, dst = pair
        twice = [k for k, n in (Counter(out) + Counter(got)).items() if n != 2]
        if twice or Counter(out) != Counter(got):
            problems.append(f"rank {src} -> rank {dst}: messages {sorted(twice)[:3]} are not "
                            "sent once and received once")
        elif out != got:
            first = next(i for i, (a, b) in enumerate(zip(out, got)) if a != b)
            problems.append(f"rank {src} -> rank {dst}: message {first} is {out[first]} on the "
                            f"sender and {got[first]} on the receiver (orders differ)")
    return problems


def _compute_of(a: Action, kinds: dict) -> Action:
    """The compute action that produces (a send) or consumes (a receive) a p2p entry."""
    if a.kind in (SEND_F, RECV_F):
        return Action(FORWARD, a.mb, a.stage, a.pipe)
    return Action(kinds.get((a.mb, a.stage, a.pipe), "BW"), a.mb, a.stage, a.pipe)


def placement_problems(lowered: Lowered) -> list[str]:
    """Sends before their producers, receives after their consumers, missing entries."""
    sched = lowered.schedule
    kinds = sched.backward_kinds()
    problems = []
    for r, row in enumerate(lowered.actions):
        where = {a: i for i, a in enumerate(row)}
        for i, a in enumerate(row):
            if a.kind in (SEND_F, RECV_F, "SB", "RB"):
                c = where.get(_compute_of(a, kinds))
                sending = a.kind in (SEND_F, "SB")
                if c is None or (c > i if sending else c < i):
                    problems.append(f"rank {r}: {a} at {i} is not {'after' if sending else 'before'}"
                                    f" its compute on the rank")
                continue
            for side, op in (("receive", needed(sched, a)), ("send", produced(sched, a))):
                if op is not None and op[1] != r and op[0] not in where:
                    problems.append(f"rank {r}: {a} has no {side} {op[0]}")
    return problems[:8]


def deadlock_free(lowered: Lowered, *, blocking: bool) -> bool:
    """Whether every rank reaches the end of its lowered list (module docstring)."""
    nodes: list[tuple[int, object]] = []   # (rank, compute action or batch)
    first: list[int] = []
    for r, row in enumerate(lowered.actions):
        first.append(len(nodes))
        nodes += [(r, item) for item in batches(row)]
    deps: list[list[int]] = [[] for _ in nodes]
    for i, (r, _) in enumerate(nodes):
        if i > first[r]:
            deps[i].append(i - 1)
    batch_of: dict[tuple, int] = {}  # (send?, key) -> node of the batch holding it
    for i, (_, item) in enumerate(nodes):
        if isinstance(item, list):
            for a in item:
                batch_of[(a.kind in (SEND_F, "SB"), transfer_key(a))] = i
    sched = lowered.schedule
    for i, (r, item) in enumerate(nodes):
        if isinstance(item, list) and blocking:
            for a in item:
                partner = batch_of[(a.kind not in (SEND_F, "SB"), transfer_key(a))]
                if partner > first[nodes[partner][0]]:
                    deps[i].append(partner - 1)  # posted once the node before it is done
        elif not isinstance(item, list) and not blocking:
            need = needed(sched, item)
            if need is not None and need[1] != r:
                deps[i].append(batch_of[(True, transfer_key(need[0]))])
    return _acyclic(deps)


def _acyclic(deps: list[list[int]]) -> bool:
    users: list[list[int]] = [[] for _ in deps]
    indegree = [len(d) for d in deps]
    for i, d in enumerate(deps):
        for j in d:
            users[j].append(i)
    ready = deque(i for i, n in enumerate(indegree) if n == 0)
    seen = 0
    while ready:
        i = ready.popleft()
        seen += 1
        for u in users[i]:
            indegree[u] -= 1
            if not indegree[u]:
                ready.append(u)
    return seen == len(deps)


def p2p_problems(lowered: Lowered, *, rendezvous: bool = False) -> list[str]:
    """What is wrong with the p2p entries of ``lowered`` (empty: nothing).

    Every send has its receive on the peer and the reverse, once each; for every ordered
    pair of ranks the sends and the receives come in the same order; a send follows its
    producer and a receive precedes its consumer on the rank; and the lists cannot deadlock
    when a compute waits only for its input to have been sent (the simulator's rule; what
    the executor needs on gloo, and on NCCL while messages fit NCCL's buffers).
    ``rendezvous=True`` checks the stricter model where a batch completes only once every
    partner has posted its half, and a rank waits for that (``lower_check.deadlock_free``).
    """
    problems = pair_orders(lowered) + placement_problems(lowered)
    if not problems and not deadlock_free(lowered, blocking=rendezvous):
        mode = "rendezvous batches" if rendezvous else "non-blocking posts"
        problems.append(f"{lowered.schedule.name}: the lowered lists deadlock with {mode}")
    return problems
