"""The verdict's own cost (issue 24): the share of a case's wall time its reference work
takes (golden run, each checked step's stepwise reference and checks, the final state's
continuation: ``Timing.verdict_share``), with the reference computed once on rank 0 and sent
to every rank (``shared_reference=true``, the default) and on every rank
(``shared_reference=false``, as before), alternately in one run, for a 2-rank and an 8-rank
case; prints per case and mode the median share and the median case wall time (the slowest
rank's), and the ratio of the case times once / every rank.

    python scripts/bench_verdict.py [repeats=5] [model=tiny] [steps=3] [timed_steps=3]
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parbench.bench import alternate, base_case, describe  # noqa: E402
from parbench.overrides import apply_overrides  # noqa: E402
from parbench.terminate import run_terminable  # noqa: E402

DEFAULTS = {"repeats": "5"}
#: the 2-rank and the 8-rank case: (label, fields)
CASES = (("data.ddp dp=2", {"scheme": "data.ddp", "dp": 2}),
         ("hybrid tp=2 dp=2 pp=2", {"scheme": "hybrid", "tp": 2, "dp": 2, "pp": 2}))


def main(argv: list[str]) -> None:
    base, repeats = base_case(argv, DEFAULTS)
    cases = {}
    for label, fields in CASES:
        for shared in ("true", "false"):
            cases[f"{label} shared_reference={shared}"] = apply_overrides(
                base, {**fields, "shared_reference": shared})
    started = time.time()
    rows = alternate(cases, repeats)
    print("\n" + describe(base, repeats, started))
    print(f"\n{'case':46s} {'verdict share':>14s} {'case s':>8s}")
    med = {}
    for label, rs in rows.items():
        share = statistics.median(r.time.verdict_share for r in rs)
        med[label] = statistics.median(r.time.case_s for r in rs)
        print(f"{label:46s} {share:13.1%} {med[label]:8.2f}")
    print()
    for label, _ in CASES:
        once, every = (med[f"{label} shared_reference={v}"] for v in ("true", "false"))
        print(f"case time, reference once / on every rank, {label}: {once / every:.3f}x")


if __name__ == "__main__":
    sys.exit(run_terminable(main, sys.argv[1:], prog="bench_verdict",
                           kept="the lines printed above are what it measured"))
