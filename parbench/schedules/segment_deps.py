"""The token-slice dependencies of Seq1F1B and TeraPipe in the simulator's integer form.

A schedule with ``segments = k > 1`` numbers its units ``u = mb * k + j`` (slice j of
micro-batch mb, ``Schedule.segments``). Beside the stage rules, within one stage:

* F of slice j > 0 needs F of slice j-1 (its attention reads that slice's cached K/V);
* the backward-for-inputs (B or BW) of slice j < k-1 needs that of slice j+1 (which
  hands it the gradients of its K/V).

`_Plan` keeps two dependency slots per action; both rules fit: a forward of a later slice
uses the slot its stage rule leaves free, and a backward of slice j < k-1 waits for the
backward of slice j+1 *instead of* its own forward, which that backward already waited for
through F(j+1) -> F(j). The same rules as ``Schedule.segment_dependencies``, which the
validator's action-by-action checks use.
"""
from __future__ import annotations

import numpy as np

from .actions import BACKWARD_FULL, BACKWARD_INPUT, FORWARD


def link_regular(plan, dep_a: np.ndarray, dep_b: np.ndarray) -> None:
    """Add the slice dependencies to a regular plan's slots (in place; -1: not listed)."""
    k = plan.schedule.segments
    if k <= 1 or not plan.n:
        return
    n, index, codes = plan.n, plan.index, plan.codes
    kind, mb, stage = plan.numbers[0][:n], plan.numbers[1][:n], plan.numbers[2][:n]
    seg = mb % k
    later_f = (kind == 0) & (seg > 0)  # code - 4: the same stage, the unit before
    prev = index[codes[later_f] - 4]
    first_stage = stage[later_f] == 0
    rows = np.flatnonzero(later_f)
    dep_a[rows[first_stage]] = prev[first_stage]
    dep_b[rows[~first_stage]] = prev[~first_stage]
    back = ((kind == 1) | (kind == 3)) & (seg < k - 1)
    up = codes[back] - kind[back] + 4  # the forward of the next unit, same stage
    inside = up + 3 < len(index)
    up = np.where(inside, up, 0)
    b, bw = index[up + 1], index[up + 3]
    listed_b, listed_bw = (b >= 0) & (b < n), (bw >= 0) & (bw < n)
    dep_a[back] = np.where(inside, np.where(listed_b & (~listed_bw | (b < bw)), b, bw), -1)


def wants_keys(schedule, key: tuple, wants: list, first: dict) -> list:
    """The dependency keys of one action of a plan numbered by keys, the slice rules added
    (a later slice's F: appended; a backward of slice j < k-1: in place of its own F)."""
    k = schedule.segments
    kind, mb, stage, pipe = key
    if k <= 1 or not isinstance(mb, int):
        return wants
    if kind == FORWARD and mb % k:
        return wants + [(FORWARD, mb - 1, stage, pipe)]
    if kind in (BACKWARD_INPUT, BACKWARD_FULL) and mb % k < k - 1:
        b = first.get((BACKWARD_INPUT, mb + 1, stage, pipe))
        bw = first.get((BACKWARD_FULL, mb + 1, stage, pipe))
        up = BACKWARD_INPUT if b is not None and (bw is None or b < bw) else BACKWARD_FULL
        return [(up, mb + 1, stage, pipe)] + wants[1:]
    return wants
