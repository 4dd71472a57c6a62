"""Greedy list scheduling: turn a set of actions and a priority into per-rank orders.

Used by generators whose paper describes the schedule as "merge these pipelines
slot by slot" rather than as a closed per-rank recipe (Chimera).  Time advances
from event to event; whenever a rank is idle it starts, among its actions whose
dependencies have all finished, the one with the smallest priority key.
"""
from __future__ import annotations

import heapq
from typing import Callable, Hashable, Iterable

from .actions import Action, Schedule, ScheduleError


def list_schedule(
    template: Schedule,
    tasks: Iterable[Action],
    priority: Callable[[Action], Hashable],
    cost: Callable[[Action], float],
) -> list[list[Action]]:
    """Per-rank action orders produced by greedy list scheduling.

    `template` supplies p, num_stages, placement and mb_pipe (its `actions` are
    ignored); dependencies follow :meth:`Schedule.dependencies`.
    """
    tasks = list(tasks)
    waiting_on, dependents = _dependency_graph(template, tasks)
    p = template.p
    candidates: list[list] = [[] for _ in range(p)]
    seq = 0

    def release(a: Action) -> None:
        nonlocal seq
        heapq.heappush(candidates[template.rank_of(a)], (priority(a), seq, a))
        seq += 1

    for a in tasks:
        if waiting_on[a] == 0:
            release(a)
    orders: list[list[Action]] = [[] for _ in range(p)]
    free = [0.0] * p
    events: list[tuple[float, int, Action]] = []
    now, done = 0.0, 0
    while True:
        for r in range(p):
            if free[r] <= now and candidates[r]:
                _, _, a = heapq.heappop(candidates[r])
                end = now + cost(a)
                orders[r].append(a)
                free[r] = end
                heapq.heappush(events, (end, seq, a))
                seq += 1
        if not events:
            break
        now = events[0][0]
        while events and events[0][0] <= now:
            _, _, a = heapq.heappop(events)
            done += 1
            for nxt in dependents[a]:
                waiting_on[nxt] -= 1
                if waiting_on[nxt] == 0:
                    release(nxt)
    if done != len(tasks):
        raise ScheduleError(f"{template.name}: list scheduling stalled with {len(tasks) - done} actions left")
    return orders


def _dependency_graph(template: Schedule, tasks: list[Action]
                      ) -> tuple[dict[Action, int], dict[Action, list[Action]]]:
    """Per task, how many dependencies it waits on, and the tasks that wait on it
    (:meth:`Schedule.dependencies`); `ScheduleError` when a dependency is not a task."""
    kinds = {(a.mb, a.stage, a.pipe): a.kind for a in tasks if a.kind in ("B", "BW")}
    present = set(tasks)
    waiting_on: dict[Action, int] = {}
    dependents: dict[Action, list[Action]] = {a: [] for a in tasks}
    for a in tasks:
        deps = [d for d in template.dependencies(a, kinds)]
        missing = [d for d in deps if d not in present]
        if missing:
            raise ScheduleError(f"{template.name}: {a} depends on {missing[0]}, which is not scheduled")
        waiting_on[a] = len(deps)
        for d in deps:
            dependents[d].append(a)
    return waiting_on, dependents
