"""Step time of native ZeRO-3 against DeepSpeed ZeRO-3 and FSDP2, and of native DDP against
torch DDP (its stock all-reduce hook, every step), on the same case; prints medians and the ratio ours / baseline
(< 1: ours faster).

    python scripts/bench_data.py [model=small] [dp=2] [timed_steps=12] [repeats=3] [key=value ...]
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parbench.bench import alternate, base_case, describe, print_ratios  # noqa: E402
from parbench.overrides import apply_overrides  # noqa: E402
from parbench.terminate import run_terminable  # noqa: E402

PAIRS = [("zero.3", "baseline.torch.fsdp2"), ("zero.3", "baseline.deepspeed.zero3"),
         ("data.ddp", "baseline.torch.ddp")]
DEFAULTS = {"model": "small", "dp": "2", "steps": "1", "timed_steps": "12",
            "warmup_steps": "2", "num_microbatches": "2", "micro_batch_size": "2",
            "bucket_mb": "1"}


def main(argv: list[str]) -> None:
    base, repeats = base_case(argv, DEFAULTS)
    schemes = sorted({s for pair in PAIRS for s in pair})
    started = time.time()
    rows = alternate({s: apply_overrides(base, {"scheme": s}) for s in schemes}, repeats)
    print("\n" + describe(base, repeats, started))
    print_ratios(rows, PAIRS)


if __name__ == "__main__":
    sys.exit(run_terminable(main, sys.argv[1:], prog="bench_data",
                           kept="the lines printed above are what it measured"))
