"""Peak in-flight counts per rank of a simulated run (``simulate``): how many micro-batches'
activations, B-without-W graphs and full graphs a rank holds at once, from the start and end
times of its actions."""
from __future__ import annotations

import numpy as np

from .actions import BACKWARD_FULL, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD
from .plan_form import _CODE_KIND, _FIELDS, _Plan


_EVENTS = {FORWARD: (1, 1, 0, 1), BACKWARD_FULL: (0, -1, 0, -1),
           BACKWARD_INPUT: (0, -1, 1, 0), BACKWARD_WEIGHT: (0, 0, -1, -1)}
#: the same by kind code (F, B, W, BW): the events' rank among those at one time, and deltas
_EVENT_RANK = np.array([3, 1, 2, 0])
_EVENT_DELTAS = [np.array([_EVENTS[k][j] for k in _CODE_KIND]) for j in (1, 2, 3)]


def _peaks(keys: list[tuple], starts: list[float], ends: list[float]) -> tuple[int, int, int]:
    """Peak in-flight activations, peak pending W and peak held graphs on one rank.

    `keys`: the rank's actions as `_FIELDS` tuples, with their start and end times.
    In a window of a longer run (``Schedule.done_before``) the micro-batches whose forward
    ran before the window and whose backward is in it count from the start.
    """
    forwards, carried_i, carried_h = set(), set(), set()
    events = []  # (time, order, d_inflight, d_wpending, d_held)
    for (kind, mb, stage, pipe), start, end in zip(keys, starts, ends):
        cell = (mb, stage, pipe)
        if kind == FORWARD:
            forwards.add(cell)
            events.append((start, *_EVENTS[kind]))
            continue
        if kind in (BACKWARD_FULL, BACKWARD_INPUT):
            carried_i.add(cell)
        if kind in (BACKWARD_FULL, BACKWARD_WEIGHT):
            carried_h.add(cell)
        if kind in _EVENTS:
            events.append((end, *_EVENTS[kind]))
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


def _all_peaks(plan: _Plan, starts: list[float], ends: list[float]) -> list[list[int]]:
    """`_peaks` of every rank: ``[peak_inflight, peak_w_pending, peak_held]``, each per rank.

    A regular plan without NaN times sorts all events at once with numpy, by (rank, time,
    event rank): the order of `_peaks`' tuples but for ties of identical events, which
    do not change a running sum.
    """
    begin, finish = np.array(starts, float), np.array(ends, float)
    if not plan.regular or np.isnan(begin).any() or np.isnan(finish).any():
        keys = plan.keys if not plan.regular else list(map(_FIELDS, plan.flat))
        rows = [_peaks(keys[lo:hi], starts[lo:hi], ends[lo:hi]) for lo, hi in plan.bounds]
        return [list(column) for column in zip(*rows)] if rows else [[], [], []]
    n, rank, rows = plan.n, plan.rank, len(plan.bounds)
    kind = plan.numbers[0][:n]
    order = np.lexsort((_EVENT_RANK[kind], np.where(kind == 0, begin, finish), rank))
    lo = np.array([lo for lo, _ in plan.bounds], np.int64)
    filled = np.array([hi > lo for lo, hi in plan.bounds], bool)
    # micro-batches carried in: a backward whose forward is not on its rank, once per cell
    cell = plan.codes - kind
    home = plan.index[cell]
    here = (home >= 0) & (home < n)
    here[here] = rank[home[here]] == rank[here]
    out = []
    for j, carried in enumerate(((kind == 1) | (kind == 3), None, (kind == 2) | (kind == 3))):
        start = np.zeros(rows, np.int64)
        if carried is not None:
            away = carried & ~here
            pairs = np.unique(rank[away] * len(plan.index) + cell[away])
            start = np.bincount(pairs // len(plan.index), minlength=rows)
        total = np.cumsum(_EVENT_DELTAS[j][kind][order])
        peak = start.copy()
        if filled.any():
            base = np.where(lo > 0, total[np.maximum(lo - 1, 0)], 0)[filled]
            top = np.maximum.reduceat(total, lo[filled]) - base + start[filled]
            peak[filled] = np.maximum(peak[filled], top)
        out.append(peak.tolist())
    return out
