"""The cost of parbench's own instrumentation: the same case with the traffic ledger and the
timeline recording (``instrument=true``) and without (``instrument=false``), alternately in
one run; prints each median and the ratio on / off (target: under 1.03 on the small model),
in wall-clock time and in CPU time (``Timing.cpu_s``: the busiest rank's process CPU seconds
per timed step, which other processes sharing the cores hardly move -- on a loaded machine
the wall-clock ratio is noise, the CPU one still shows the instrumentation's own work).

    python scripts/bench_overhead.py [model=small] [dp=2] [repeats=5] [schemes=data.ddp,zero.3]
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parbench.bench import alternate, base_case, describe, print_ratios  # noqa: E402
from parbench.overrides import apply_overrides, parse_overrides  # noqa: E402
from parbench.terminate import run_terminable  # noqa: E402

DEFAULTS = {"model": "small", "dp": "2", "steps": "1", "timed_steps": "12",
            "warmup_steps": "2", "num_microbatches": "2", "micro_batch_size": "2",
            "bucket_mb": "1", "repeats": "5"}


def main(argv: list[str]) -> None:
    given = parse_overrides(argv)
    schemes = given.pop("schemes", "data.ddp,zero.3").split(",")
    base, repeats = base_case([f"{k}={v}" for k, v in given.items()], DEFAULTS)
    cases, pairs = {}, []
    for s in schemes:
        for on in ("true", "false"):
            cases[f"{s} instrument={on}"] = apply_overrides(base, {"scheme": s,
                                                                   "instrument": on})
        pairs.append((f"{s} instrument=true", f"{s} instrument=false"))
    started = time.time()
    rows = alternate(cases, repeats)
    print("\n" + describe(base, repeats, started))
    print_ratios(rows, pairs)
    print_cpu_ratios(rows, pairs)


def print_cpu_ratios(rows: dict, pairs: list[tuple[str, str]]) -> None:
    """Median CPU ms per timed step per label, then 'on / off' per pair."""
    def cpu_ms(label: str) -> float:
        return statistics.median(r.time.cpu_s for r in rows[label]) * 1e3
    print(f"\n{'case':36s} {'median CPU ms':>15s}")
    for label in rows:
        print(f"{label:36s} {cpu_ms(label):15.2f}")
    print()
    for on, off in pairs:
        print(f"CPU ratio {on} / {off}: {cpu_ms(on) / cpu_ms(off):.3f}x")


if __name__ == "__main__":
    sys.exit(run_terminable(main, sys.argv[1:], prog="bench_overhead",
                           kept="the lines printed above are what it measured"))
