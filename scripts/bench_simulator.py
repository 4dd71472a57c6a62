"""The schedule simulator's speed on large schedules: generation (``make_schedule``),
validation (``validate``) and simulation (``simulate``, unit costs) timed apart, best total
of ``repeats`` runs, against the targets of issue 12 (item 5): 1F1B at p=64, m=1024 under
0.5 s and interleaved at p=64, m=512, v=4 under 1 s, generation and validation included.
The other rows are reported without a target.

    python scripts/bench_simulator.py [repeats=5] [cases=1f1b,interleaved]

Prints one row per case and exits 1 when a case misses its target.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parbench.overrides import parse_overrides  # noqa: E402
from parbench.schedules import make_schedule, simulate, validate  # noqa: E402

#: (schedule, p, m, v, simulate's keyword arguments, target for the total in seconds)
CASES = [
    ("1f1b", 64, 1024, None, {}, 0.5),
    ("interleaved", 64, 512, 4, {}, 1.0),
    ("1f1b", 64, 1024, None, {"tf": 1.0, "tb": 2.0, "tw": 0.5, "p2p": 0.1}, None),
    ("gpipe", 64, 1024, None, {}, None),
    ("zb-h1", 64, 1024, None, {}, None),
    ("zbv", 32, 1024, None, {}, None),
    ("chimera", 16, 256, None, {}, None),
    ("dualpipev", 32, 512, None, {"overlap": True}, None),
]


def time_case(name: str, p: int, m: int, v: int | None, costs: dict,
              repeats: int) -> tuple[int, list[float]]:
    """Actions, and (generation, validation, simulation) seconds of the fastest run."""
    best = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        schedule = make_schedule(name, p, m, v)
        t1 = time.perf_counter()
        validate(schedule)
        t2 = time.perf_counter()
        simulate(schedule, **costs)
        t3 = time.perf_counter()
        phases = [t1 - t0, t2 - t1, t3 - t2]
        if best is None or sum(phases) < sum(best):
            best = phases
        size = schedule.num_actions()
        del schedule
    return size, best


def main(argv: list[str]) -> int:
    given = parse_overrides(argv)
    repeats = int(given.pop("repeats", "5"))
    only = [c for c in given.pop("cases", "").split(",") if c]
    if given:
        raise SystemExit(f"unknown option {next(iter(given))!r} (repeats, cases)")
    print(f"{'case':44s} {'actions':>8s} {'generate':>9s} {'validate':>9s} {'simulate':>9s} "
          f"{'total':>8s} {'target':>7s}")
    missed = 0
    for name, p, m, v, costs, target in CASES:
        if only and name not in only:
            continue
        size, phases = time_case(name, p, m, v, costs, repeats)
        total = sum(phases)
        label = f"{name} p={p} m={m}" + (f" v={v}" if v else "") + "".join(
            f" {k}={x}" for k, x in costs.items())
        verdict = "" if target is None else ("PASS" if total < target else "MISS")
        missed += verdict == "MISS"
        print(f"{label:44s} {size:8d} " + " ".join(f"{t:8.3f}s" for t in phases)
              + f" {total:7.3f}s " + (f"{target:6.1f}s {verdict}" if target else "      —"),
              flush=True)
    print(f"\nbest of {repeats} runs each (seconds of wall time, Python "
          f"{sys.version.split()[0]}); the totals include generation and validation")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
