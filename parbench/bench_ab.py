"""The instruments' cost (issue 24: "instrumentation <= 3% of step time, shown with enough
repeats that its spread is smaller than the effect"), from ``instrument_ab`` rows: the timed
steps alternate the ledger and timeline on and off on the same ranks, and each step with them
is paired with the next step without.

Two figures per pair:

- the wall-clock ratio (on / off) of the slowest rank's step, median over the step pairs;
  on shared cores it moves by more than the effect from one step to the next;
- the instruments' work as a share of the step's: their own-thread CPU -- the ledger's
  records and the timeline's spans run on the calling thread (``parbench.thread_cpu``) --
  summed over the ranks, on minus off, over the ranks' process CPU of the step without them.
  CPU seconds are hardly moved by other processes on the cores, so the spread of this share
  over runs is a fraction of a percent.
"""
from __future__ import annotations

import statistics

from .bench_pairs import Pair, PairResult, _passed, _where, case_key


def ab_steps(row, per_rank: list[list[float]] | None = None, combine=max
             ) -> tuple[list[float], list[float]]:
    """(on, off): an ``instrument_ab`` row's timed steps with and without the instruments,
    each the slowest rank's seconds, paired: off[i] is the step right after on[i]
    (``per_rank``: other per-step figures of the row's ranks, e.g. their own-thread CPU,
    ``combine``-d over the ranks)."""
    per_rank = row.time.per_rank_s if per_rank is None else per_rank
    if not per_rank or not all(per_rank):
        return [], []
    n = min(len(ts) for ts in per_rank)
    slowest = [combine(ts[k] for ts in per_rank) for k in range(n)]
    first = row.case.config["run"]["warmup_steps"]  # step_times start after the warm-up
    on_at = [k for k in range(n - 1) if (first + k) % 2 == 0]
    return [slowest[k] for k in on_at], [slowest[k + 1] for k in on_at]


def _medians(per_row: list[list[float]]) -> tuple[float | None, float | None, float | None]:
    """(median over every value, lowest row median, highest row median)."""
    every = [x for r in per_row for x in r]
    runs = [statistics.median(r) for r in per_row if r]
    if not every:
        return None, None, None
    return statistics.median(every), min(runs), max(runs)


def _ratios(on: list[float], off: list[float]) -> list[float]:
    return [x / y for x, y in zip(on, off) if x and y]


def own_ratios(row) -> list[float]:
    """Per step pair: the ranks' own-thread CPU with the instruments over without."""
    return _ratios(*ab_steps(row, getattr(row.time, "per_rank_own_cpu_s", None), sum))


def shares(row) -> list[float]:
    """Per step pair: (own CPU with - own CPU without, summed over the ranks) / the ranks'
    process CPU without."""
    t = row.time
    own_on, own_off = ab_steps(row, getattr(t, "per_rank_own_cpu_s", None), sum)
    _, cpu_off = ab_steps(row, getattr(t, "per_rank_cpu_s", None), sum)
    return [(a - b) / c for a, b, c in zip(own_on, own_off, cpu_off) if c]


def summarise_ab(pair: Pair, rows: list) -> PairResult:
    """The instruments' pair: ``ratio`` the median wall ratio over every run's step pairs,
    ``low`` / ``high`` the lowest and highest run's median; ``own_ratio`` the same of the
    ranks' own-thread CPU; ``share`` (and its runs' spread) the instruments' CPU over the
    step's."""
    steps = [ab_steps(r) for r in rows]  # (on, off) wall seconds per row
    walls = [_ratios(on, off) for on, off in steps]
    ratio, low, high = _medians(walls)
    own = _medians([own_ratios(r) for r in rows])[0]
    share, share_low, share_high = _medians([shares(r) for r in rows])
    on = [x for s in steps for x in s[0]]
    off = [x for s in steps for x in s[1]]
    nan = float("nan")
    return PairResult(pair.label, pair.kind,
                      statistics.median(on) * 1e3 if on else nan,
                      statistics.median(off) * 1e3 if off else nan,
                      nan if ratio is None else ratio, nan if low is None else low,
                      nan if high is None else high,
                      sum(1 for w in walls if w), _passed(rows), _where(pair),
                      key=case_key(pair), own_ratio=own, share=share, share_low=share_low,
                      share_high=share_high)
