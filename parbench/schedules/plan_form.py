"""A schedule in integer form for the simulator (``simulate``): every action numbered once,
its dependencies and the p2p latencies looked up once, so the simulation loop touches plain
lists and arrays instead of hashing ``Action`` objects."""
from __future__ import annotations

from itertools import accumulate, chain, repeat
from math import inf
from operator import attrgetter

import numpy as np

from . import segment_deps
from .actions import BACKWARD_FULL, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, Action, Schedule


_FIELDS = attrgetter("kind", "mb", "stage", "pipe")  # the fields `Action` equality compares
_KIND_CODE = {FORWARD: 0, BACKWARD_INPUT: 1, BACKWARD_WEIGHT: 2, BACKWARD_FULL: 3}
_CODE_KIND = (FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, BACKWARD_FULL)


def _numbers(actions: list[Action]) -> list[np.ndarray] | None:
    """Kind code, mb, stage and pipe of `actions` as int64 arrays, or None unless every kind
    is known and every mb, stage and pipe a non-negative integer (an int, a bool or a numpy
    integer: numbers that compare and hash as their int does)."""
    n = len(actions)
    kinds = np.fromiter(map(_KIND_CODE.get, map(attrgetter("kind"), actions), repeat(4)),
                        np.int64, n)
    if n and kinds.max() > 3:
        return None
    out = [kinds]
    for name in ("mb", "stage", "pipe"):
        values = np.array(list(map(attrgetter(name), actions)))  # floats, str, big ints: no
        if n and values.dtype.kind not in "iub":
            return None
        out.append(values.astype(np.int64))
        if n and out[-1].min() < 0:
            return None
    return out


class _Plan:
    """A schedule in integer form, for the worklist of :func:`run_times` and the validator.

    The listed actions are numbered rank by rank ("occurrences", rank r holding
    ``bounds[r] = (lo, hi)``).  Availability lives in a table of slots: slot u < n is
    the action first listed at occurrence u (``slot[i]``: the slot of occurrence i; a
    repeated action shares its first one), `NONE` stands for "no dependency" (available
    since -inf), `MISSING` for a dependency neither listed nor done before (never
    available), and the slots after them for the `done_before` actions that are not
    listed (available at 0).

    Two ways in, one result: a *regular* schedule (known kinds, non-negative int fields,
    no action listed twice -- every generated one) is numbered with numpy, each action
    by a code ``((pipe * S + stage) * M + mb) * 4 + kind`` into a dense table; any other
    by a dict of field tuples.  :meth:`link` then fills ``dep_a[i]``, ``dep_b[i]``: the
    slots occurrence i waits for, in `Schedule.dependencies` order (one inside its own
    overlapped unit reads `NONE`), with the latencies ``lag_a``, ``lag_b``, and
    ``pairs``: the occurrences that start an overlapped unit of two.
    """

    def __init__(self, schedule: Schedule):
        self.schedule = schedule
        self.flat = flat = list(chain.from_iterable(schedule.actions))
        self.n = n = len(flat)
        lengths = list(map(len, schedule.actions))
        ends = list(accumulate(lengths))
        self.bounds = [(end - size, end) for size, end in zip(lengths, ends)]
        self.rank = np.repeat(np.arange(len(lengths)), lengths)
        self.NONE, self.MISSING = n, n + 1
        before = list(schedule.done_before)
        self.numbers = _numbers(flat + before)
        self.regular = self.numbers is not None and self._encode(before)
        self.unique = True
        if not self.regular:
            self.keys = list(map(_FIELDS, flat))
            self.first = dict(zip(self.keys, range(n)))
            self.unique = len(self.first) == n
            if not self.unique:  # a repeated action: its first occurrence holds the slot
                self.first = {}
                for i, key in enumerate(self.keys):
                    self.first.setdefault(key, i)
            self.slot = list(map(self.first.__getitem__, self.keys))

    def _encode(self, before: list[Action]) -> bool:
        """Number a regular schedule; False when an action is listed twice or the codes
        would be too sparse for a table."""
        n = self.n
        kind, mb, stage, pipe = self.numbers
        if not len(kind):
            self.M = self.S = 1
        else:
            self.M, self.S = int(mb.max()) + 1, int(stage.max()) + 2
        self.P = int(pipe.max()) + 1 if len(pipe) else 1
        size = self.P * self.S * self.M * 4
        if size > 16 * (n + len(before)) + (1 << 16):
            return False
        codes = ((pipe * self.S + stage) * self.M + mb) * 4 + kind
        self.codes, before_codes = codes[:n], codes[n:]
        self.index = index = np.full(size, -1, np.int64)
        index[self.codes] = np.arange(n)
        if n and (index[self.codes] != np.arange(n)).any():
            return False
        self.before = [int(i) for i in index[before_codes] if i >= 0]  # listed, done before
        fresh = np.unique(before_codes[index[before_codes] < 0])
        index[fresh] = np.arange(n + 2, n + 2 + len(fresh))
        self.extra = len(fresh)
        self.slot = range(n)
        return True

    def link(self, p2p=0.0, overlap: bool = False) -> "_Plan":
        """Fill the dependencies, latencies, overlapped units and initial availability."""
        n = self.n
        starts = self._pair_starts() if overlap and self.schedule.overlapped else []
        self.pairs = set(starts)
        if self.regular:
            self.deps = self._dependencies_regular()
            if starts:  # a dependency inside its own unit is no wait
                first = np.array(starts)
                for d in self.deps:
                    for j in (first, first + 1):
                        inside = (d[j] == first) | (d[j] == first + 1)
                        d[j[inside]] = self.NONE
            self.avail = [None] * (n + 2) + [0.0] * self.extra
            for i in self.before:
                self.avail[i] = 0.0
            cross = [self._cross(d) for d in self.deps]
            self.dep_a, self.dep_b = (d.tolist() for d in self.deps)
        else:
            self._dependencies_keys()
            slot = self.slot
            for i in starts:
                for deps in (self.dep_a, self.dep_b):
                    for j in (i, i + 1):
                        if deps[j] in (slot[i], slot[i + 1]):
                            deps[j] = self.NONE
            rank = self.rank.tolist()
            cross = [[d < n and rank[d] != rank[i] for i, d in enumerate(deps)]
                     for deps in (self.dep_a, self.dep_b)]
        self.avail[self.NONE] = -inf
        # a cross-rank dependency pays the latency (one done before: not)
        if type(p2p) is float:
            self.lag_a, self.lag_b = (np.where(c, p2p, 0.0).tolist() for c in cross)
        else:
            lags = (0.0, p2p)
            self.lag_a, self.lag_b = (list(map(lags.__getitem__, np.asarray(c, bool).tolist()))
                                      for c in cross)
        return self

    def _cross(self, deps: np.ndarray) -> np.ndarray:
        listed = deps < self.n
        home = self.rank[np.where(listed, deps, 0)] if self.n else self.rank
        return listed & (home != self.rank)

    def _dependencies_regular(self) -> tuple[np.ndarray, np.ndarray]:
        n, index, codes = self.n, self.index, self.codes
        kind, stage = self.numbers[0][:n], self.numbers[2][:n]
        dep_a, dep_b = np.full(n, self.NONE), np.full(n, self.NONE)
        step = 4 * self.M  # one stage, same mb and kind
        f = (kind == 0) & (stage > 0)
        dep_a[f] = index[codes[f] - step]
        w = kind == 2
        dep_a[w] = index[codes[w] - 1]
        back = (kind == 1) | (kind == 3)
        cell = codes - kind  # the forward of the same (mb, stage, pipe)
        dep_a[back] = index[cell[back]]
        nxt = back & (stage < self.schedule.num_stages - 1)
        up = cell[nxt] + step  # the next stage's backward: its first listed B or BW
        b, bw = index[up + 1], index[up + 3]
        listed_b, listed_bw = (b >= 0) & (b < n), (bw >= 0) & (bw < n)
        dep_b[nxt] = np.where(listed_b & (~listed_bw | (b < bw)), b, bw)
        segment_deps.link_regular(self, dep_a, dep_b)  # token slices (Seq1F1B, TeraPipe)
        for deps in (dep_a, dep_b):
            deps[deps < 0] = self.MISSING
        return dep_a, dep_b

    def _dependencies_keys(self) -> None:
        n, keys, first, none, missing = self.n, self.keys, self.first, self.NONE, self.MISSING
        self.avail: list[float | None] = [None] * (n + 2)
        before: dict[tuple, int] = {}
        for a in self.schedule.done_before:
            key = _FIELDS(a)
            if key in first:
                self.avail[first[key]] = 0.0
            elif key not in before:
                before[key] = len(self.avail)
                self.avail.append(0.0)
        self.dep_a, self.dep_b = [none] * n, [none] * n
        last = self.schedule.num_stages - 1
        for i, (kind, mb, stage, pipe) in enumerate(keys):
            wants = []
            if kind == FORWARD:
                if stage > 0:
                    wants.append((FORWARD, mb, stage - 1, pipe))
            elif kind == BACKWARD_WEIGHT:
                wants.append((BACKWARD_INPUT, mb, stage, pipe))
            else:
                wants.append((FORWARD, mb, stage, pipe))
                if stage < last:  # the next stage's backward: its first listed B or BW
                    b = first.get((BACKWARD_INPUT, mb, stage + 1, pipe))
                    bw = first.get((BACKWARD_FULL, mb, stage + 1, pipe))
                    up = BACKWARD_INPUT if b is not None and (bw is None or b < bw) \
                        else BACKWARD_FULL
                    wants.append((up, mb, stage + 1, pipe))
            wants = segment_deps.wants_keys(self.schedule, keys[i], wants, first)
            for deps, key in zip((self.dep_a, self.dep_b), wants):
                u = first.get(key)
                deps[i] = before.get(key, missing) if u is None else u

    def codes_of(self, actions: list) -> list[int | None]:
        """The codes of `actions` in a regular plan's table (None: one that is not listed)."""
        fields = _numbers(actions) if all(isinstance(a, Action) for a in actions) else None
        if fields is None:
            return [c for a in actions for c in self.codes_of([a])] if len(actions) > 1 \
                else [None] * len(actions)
        kind, mb, stage, pipe = fields
        inside = (mb < self.M) & (stage < self.S) & (pipe < self.P)
        code = ((np.where(inside, pipe, 0) * self.S + stage) * self.M + mb) * 4 + kind
        return [c if ok else None for c, ok in zip(code.tolist(), inside.tolist())]

    def _pair_starts(self) -> list[int]:
        """The occurrences that start an overlapped unit, as `run_times` scans each row: an
        action whose partner is listed right after it pairs with it, and the scan goes on
        after the partner."""
        overlapped = self.schedule.overlapped
        if self.regular:
            codes = self.codes_of([a for pair in overlapped for a in pair])
            partner = dict(zip(codes[::2], codes[1::2]))
            partner.pop(None, None)
            first = self.index[np.array(list(partner), np.int64)]
            mate = np.array([-1 if c is None else c for c in partner.values()], np.int64)
            mate = np.where(mate >= 0, self.index[mate], -1)
            found = (first >= 0) & (first < self.n) & (mate == first + 1)
            found[found] = self.rank[first[found]] == self.rank[mate[found]]
            candidates = np.sort(first[found]).tolist()
        else:
            partner, flat = dict(overlapped), self.flat
            candidates = [i for lo, hi in self.bounds for i in range(lo, hi - 1)
                          if (mate := partner.get(flat[i])) is not None and flat[i + 1] == mate]
        starts, after = [], -1
        for i in candidates:
            if i > after:  # not the second half of the unit before
                starts.append(i)
                after = i + 1
        return starts
