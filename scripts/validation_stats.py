"""The statistics of ``validate_timemodel.py``: Spearman's rank correlation and the
measurement's repeatability."""
from __future__ import annotations

import math
import statistics


def ranks(xs: list[float]) -> list[float]:
    """Ranks 1..n, ties given their average rank."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    out = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def repeatability(rows, tol: float) -> tuple[int, int]:
    """How often one repeat of a case lies within ``tol`` of the mean of its other repeats
    (relative to that repeat, as a prediction's error is): (within, tried), over every
    repeat of every case measured at least twice. The share is what the measurement itself
    allows: a model that predicted each case's mean exactly would score about as well
    against a single repeat."""
    within = tried = 0
    for r in rows:
        ts = r.get("repeats_s") or []
        for i, t in enumerate(ts):
            others = ts[:i] + ts[i + 1:]
            if not others or t <= 0:
                continue
            tried += 1
            within += abs(sum(others) / len(others) - t) / t <= tol
    return within, tried


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rho: Pearson's correlation of the ranks."""
    if len(a) < 2:
        return float("nan")
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = math.sqrt(sum((x - ma) ** 2 for x in ra))
    vb = math.sqrt(sum((y - mb) ** 2 for y in rb))
    return cov / (va * vb) if va and vb else float("nan")
