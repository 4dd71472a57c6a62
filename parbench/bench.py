"""What the benchmark scripts share: run labelled cases alternately on one pool per world size,
``repeats`` times, and print medians and ratios measured in that one run.

Alternating the cases of a comparison makes slow drift of a shared machine hit both sides;
each case's figure is the median over its repeats of the harness's median step time (slowest
rank, timed steps only). No assertions: benchmarks print numbers.
"""
from __future__ import annotations

import statistics
import time

from .config import CaseConfig
from .overrides import apply_overrides, parse_overrides
from .results import Row
from .runner import PoolCache, case_row
from .registry import get_scheme


def base_case(argv: list[str], defaults: dict[str, str]) -> tuple[CaseConfig, int]:
    """The case the command line describes (``defaults`` first) and ``repeats=`` (default 3)."""
    ov = {**defaults, **parse_overrides(argv)}
    repeats = int(ov.pop("repeats", 3))
    return apply_overrides(CaseConfig(), ov), repeats


def alternate(cases: dict[str, CaseConfig], repeats: int, verbose: bool = True
              ) -> dict[str, list[Row]]:
    """Every labelled case once per repeat, in turn; returns the rows per label."""
    rows: dict[str, list[Row]] = {label: [] for label in cases}
    pools = PoolCache()
    try:
        for rep in range(repeats):
            for label, case in cases.items():
                cls = get_scheme(case.run.scheme)
                cls.check(case)
                row = case_row(case, None if cls.isolated else pools.get(case))
                rows[label].append(row)
                if verbose:
                    wire = sum(row.traffic.wire_max().values())
                    print(f"  repeat {rep + 1}/{repeats} {label:34s} "
                          f"{(row.time.step_s or 0) * 1e3:8.2f} ms  wire {wire / 2**10:9.1f} KiB"
                          f"  {'pass' if row.passed else 'FAIL'}", flush=True)
    finally:
        pools.close()
    return rows


def median_ms(rows: list[Row]) -> float:
    return statistics.median(r.time.step_s for r in rows) * 1e3


def describe(case: CaseConfig, repeats: int, started: float) -> str:
    m, p, r = case.model, case.layout, case.run
    return (f"case: model={m.name} (h={m.hidden_size}, layers={m.num_layers}, "
            f"seq={m.seq_length}), tp={p.tp} dp={p.dp} pp={p.pp}, micro-batches="
            f"{p.num_microbatches}x{p.micro_batch_size}, dtype={r.dtype}, "
            f"{r.timed_steps - r.warmup_steps} timed steps x {repeats} repeats "
            f"({time.time() - started:.0f} s)")


def print_ratios(rows: dict[str, list[Row]], pairs: list[tuple[str, str]]) -> None:
    """Medians per label, then 'ours / theirs' for each pair (< 1: the first is faster)."""
    print(f"{'case':36s} {'median step ms':>15s}  verdict")
    for label, rs in rows.items():
        verdict = "pass" if all(r.passed for r in rs) else "FAIL"
        print(f"{label:36s} {median_ms(rs):15.2f}  {verdict}")
    print()
    for ours, theirs in pairs:
        ratio = median_ms(rows[ours]) / median_ms(rows[theirs])
        print(f"ratio {ours} / {theirs}: {ratio:.3f}x")
