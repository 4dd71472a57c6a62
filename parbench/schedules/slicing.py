"""Token slicing of a sequence: uniform, and TeraPipe's dynamic programme.

TeraPipe (Li et al. 2021, ICML, arXiv 2102.07988, Sec. 3.3 and Algorithm 1): with a
sequence of L tokens cut into slices l_1..l_n and t_i the time one stage spends on slice i
(which depends on its length and on the context before it -- its attention reads the
cached K/V of every earlier token), the pipeline latency over K stages is

    T = sum_i t_i + (K - 1) * max_j t_j.

Algorithm 1 fixes a bound t_max on the largest slice time, finds the slicing of least total
time with every slice under the bound (``S*(i) = min_k S*(k) + t(i - k, k)`` over the first
i tokens), and takes the best bound over all candidate slice times. Here the total counts
the m micro-batches that stream through with the same slicing: ``T = m sum t_i + (K-1)
max t_j`` (the paper's single-sequence objective at m = 1).

The paper measures t(l, c) on the cluster; parbench uses a closed-form cost instead
(:class:`SliceCost`), per layer of the reference model, in multiply-accumulates:

    t(l, c) = alpha + beta l + gamma l (c + (l + 1) / 2)

* beta = 12 h^2: the QKV (3h^2), output projection (h^2) and MLP (8h^2 at f = 4h) per token;
* gamma = 2h: QK^T and AV for one (query, key) pair; a slice of l queries after c cached
  tokens forms l c + l (l + 1) / 2 causal pairs;
* alpha: a fixed cost per slice (kernel launches, a pipeline hand-off), stated in tokens:
  ``alpha = beta * overhead_tokens`` (default 16) -- the term that keeps slices from
  shrinking to single tokens (a short slice leaves an accelerator underused, the reason the
  paper does not slice to single tokens).

``segments`` fixes the number of slices (parbench's ``parallel.seq_segments``, so the
schedule's shape does not depend on the costs); ``count=None`` lets the programme choose it,
as the paper's does. The scheme's programme cuts at multiples of ceil(s / 64) tokens
(``DP_POSITIONS``), which keeps it under a second for long sequences; at s <= 64 it is exact.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import inf

import numpy as np


#: cut points the scheme's programme considers at most (granularity ceil(s / 64))
DP_POSITIONS = 64


@dataclass(frozen=True)
class SliceCost:
    """t(l, c) = alpha + beta l + gamma l (c + (l + 1)/2), see the module docstring."""

    alpha: float
    beta: float
    gamma: float

    @classmethod
    def for_model(cls, hidden: int, overhead_tokens: float = 16.0) -> "SliceCost":
        """The reference model's coefficients at hidden size h (per layer, MACs)."""
        beta = 12.0 * hidden * hidden
        return cls(alpha=beta * overhead_tokens, beta=beta, gamma=2.0 * hidden)

    def __call__(self, length: int, context: int) -> float:
        return self.alpha + self.beta * length + \
            self.gamma * length * (context + (length + 1) / 2)


def uniform_slices(seq_length: int, segments: int) -> list[int]:
    """Slice lengths as even as they go: the first ``seq_length % segments`` one longer."""
    if not 1 <= segments <= seq_length:
        raise ValueError(f"segments={segments} must be in [1, seq_length={seq_length}]")
    base, extra = divmod(seq_length, segments)
    return [base + (1 if j < extra else 0) for j in range(segments)]


def latency(lengths: list[int], cost, stages: int, m: int = 1) -> float:
    """TeraPipe's Sec. 3.3 latency for m micro-batches: ``m sum t_i + (K-1) max t_i``."""
    times, context = [], 0
    for length in lengths:
        times.append(cost(length, context))
        context += length
    return m * sum(times) + (stages - 1) * max(times)


def _least_total(table: np.ndarray, bound: float, count: int | None):
    """Least ``sum t_i`` over slicings with every ``t_i <= bound``, exactly ``count`` slices
    when given (``table[j, i]``: the cost of a slice from cut point j to cut point i, inf
    where i <= j): ``(total, the slices' end points)`` or ``(inf, None)``. One pass over
    the cut points per slice (count given), or Algorithm 1's single pass
    ``S*(i) = min_j S*(j) + t(i - j, j)`` (count None)."""
    size = table.shape[0]
    allowed = np.where(table <= bound, table, inf)
    if count is None:
        best, came = np.full(size, inf), np.full(size, -1)
        best[0] = 0.0
        for i in range(1, size):
            options = best[:i] + allowed[:i, i]
            came[i] = int(np.argmin(options))
            best[i] = options[came[i]]
        cuts = None
    else:
        best = np.full(size, inf)
        best[0] = 0.0
        cuts = []
        for _ in range(count):
            options = best[:, None] + allowed      # [j, i]: the last slice is j..i
            came = np.argmin(options, axis=0)
            best = options[came, np.arange(size)]
            cuts.append(came)
    if best[-1] == inf:
        return inf, None
    ends, i, level = [], size - 1, len(cuts or ())
    while i > 0:
        level -= 1
        ends.append(i)
        i = int((cuts[level] if cuts is not None else came)[i])
    return float(best[-1]), ends[::-1]


def dp_slices(seq_length: int, cost, stages: int, m: int = 1, count: int | None = None,
              granularity: int = 1) -> list[int]:
    """TeraPipe's Algorithm 1: the slicing minimising ``latency`` (ties: the smallest bound
    that reaches the least latency). ``count``: the number of slices (None: free);
    ``granularity``: cuts only at multiples of it (the paper coarsens the same way to bound
    the cost of the search; 1: exact over all slicings)."""
    if count is not None and not 1 <= count <= seq_length:
        raise ValueError(f"count={count} must be in [1, seq_length={seq_length}]")
    cuts = sorted(set(range(0, seq_length, granularity)) | {seq_length})
    if count is not None and count > len(cuts) - 1:
        raise ValueError(f"count={count} slices need cuts finer than granularity="
                         f"{granularity} over seq_length={seq_length}")
    size = len(cuts)
    table = np.full((size, size), inf)
    for j in range(size - 1):
        for i in range(j + 1, size):
            table[j, i] = cost(cuts[i] - cuts[j], cuts[j])
    floor, _ = _least_total(table, inf, count)  # no bound: the least total of all
    best_value, best_ends = inf, None
    for bound in np.unique(table[table < inf]).tolist():
        if m * floor + (stages - 1) * bound >= best_value:
            break  # no later (larger) bound can do better
        total, ends = _least_total(table, bound, count)
        if ends is None:
            continue
        value = m * total + (stages - 1) * bound
        if value < best_value:
            best_value, best_ends = value, ends
    points = [0] + [cuts[i] for i in best_ends]
    return [b - a for a, b in zip(points, points[1:])]


def slices_for(seq_length: int, segments: int, slicing: str, *, hidden: int, stages: int,
               m: int) -> list[int]:
    """The slice lengths a case runs: ``uniform`` or TeraPipe's ``dp`` with ``segments``
    slices under ``SliceCost.for_model(hidden)``."""
    if slicing == "uniform" or segments == 1:
        return uniform_slices(seq_length, segments)
    if slicing == "dp":
        # at most DP_POSITIONS cut points, and never fewer than the slices need
        granularity = max(1, min(-(-seq_length // DP_POSITIONS), seq_length // segments))
        return dp_slices(seq_length, SliceCost.for_model(hidden), stages, m, count=segments,
                         granularity=granularity)
    raise ValueError(f"slicing={slicing!r} must be uniform or dp")


def unit_cost(slices: list[int], cost, backward: float = 2.0):
    """``cost(action)`` for the simulator: a unit of slice j costs t(l_j, c_j) forward and
    ``backward`` times that for its fused backward (units ``u = mb * k + j``)."""
    k, times, context = len(slices), [], 0
    for length in slices:
        times.append(cost(length, context))
        context += length

    def of(action) -> float:
        t = times[action.mb % k]
        return t if action.kind == "F" else backward * t
    return of


def slicing_figures(seq_length: int, segments: int, *, hidden: int, stages: int,
                    m: int) -> dict:
    """TeraPipe's Sec. 3.3 latency (per layer, MACs of ``SliceCost.for_model``) of the whole
    sequence as one slice, ``segments`` uniform slices and the programme's slices."""
    cost = SliceCost.for_model(hidden)
    uniform = uniform_slices(seq_length, segments)
    dp = slices_for(seq_length, segments, "dp", hidden=hidden, stages=stages, m=m)
    return {"cost_model": f"t(l, c) = {cost.alpha:g} + {cost.beta:g} l + {cost.gamma:g} "
                          "l (c + (l+1)/2) per layer (MACs)",
            "slices_uniform": uniform, "slices_dp": dp,
            "latency_one_slice": latency([seq_length], cost, stages, m),
            "latency_uniform": latency(uniform, cost, stages, m),
            "latency_dp": latency(dp, cost, stages, m)}
