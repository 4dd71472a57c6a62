"""The cost of parbench's own instrumentation: the same case with the traffic ledger and the
timeline recording (``instrument=true``) and without (``instrument=false``), alternately in
one run; prints each median and the ratio on / off (target: under 1.03 on the small model).

    python scripts/bench_overhead.py [model=small] [dp=2] [repeats=5] [schemes=data.ddp,zero.3]
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parbench.bench import alternate, base_case, describe, print_ratios  # noqa: E402
from parbench.overrides import apply_overrides, parse_overrides  # noqa: E402

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


if __name__ == "__main__":
    main(sys.argv[1:])
