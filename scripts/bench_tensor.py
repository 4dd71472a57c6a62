"""Step time of native Megatron tensor parallelism (1D and sequence-parallel) against PyTorch
DTensor (``parallelize_module``) and Megatron-Core 0.16 on the same case; prints medians and
the ratio ours / baseline (< 1: ours faster). Megatron-Core is left out, saying why, where
it is not installed.

    python scripts/bench_tensor.py [model=small] [tp=2] [timed_steps=12] [repeats=3]
                                   [only=sp|tp] [key=value ...]
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parbench.bench import alternate, base_case, describe, print_ratios  # noqa: E402
from parbench.overrides import apply_overrides  # noqa: E402
from parbench.registry import get_scheme  # noqa: E402
from parbench.terminate import run_terminable  # noqa: E402

PAIRS = [("tensor.megatron", "baseline.dtensor.tp"),
         ("tensor.megatron", "baseline.megatron.tp"),
         ("tensor.megatron-sp", "baseline.dtensor.sp"),
         ("tensor.megatron-sp", "baseline.megatron.sp")]
DEFAULTS = {"model": "small", "tp": "2", "steps": "1", "timed_steps": "12",
            "warmup_steps": "2", "num_microbatches": "2", "micro_batch_size": "2"}


def main(argv: list[str]) -> None:
    only = next((a.split("=", 1)[1] for a in argv if a.startswith("only=")), None)
    argv = [a for a in argv if not a.startswith("only=")]
    base, repeats = base_case(argv, DEFAULTS)
    pairs = []
    for ours, theirs in PAIRS:
        if only and not theirs.endswith("." + only):
            continue
        missing = get_scheme(theirs).unavailable()
        if missing:
            print(f"skipping {theirs}: {missing}")
            continue
        pairs.append((ours, theirs))
    schemes = sorted({s for pair in pairs for s in pair})
    started = time.time()
    rows = alternate({s: apply_overrides(base, {"scheme": s}) for s in schemes}, repeats)
    print("\n" + describe(base, repeats, started))
    print_ratios(rows, pairs)


if __name__ == "__main__":
    sys.exit(run_terminable(main, sys.argv[1:], prog="bench_tensor",
                           kept="the lines printed above are what it measured"))
