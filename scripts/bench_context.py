"""Step time of our context-parallel schemes against DeepSpeed-Ulysses (``DistributedAttention``
+ engine) and torch's ``context_parallel`` (ring attention on DTensor + DDP) on the same case;
prints medians and the ratio ours / baseline (< 1: ours faster).

    python scripts/bench_context.py [model=small] [seq_length=256] [cp=2] [timed_steps=8]
                                    [repeats=3] [key=value ...]

Pairs: ``context.ulysses`` / ``baseline.deepspeed.ulysses`` and ``context.ring-attention``
(zig-zag, torch's head-tail layout) / ``baseline.torch.context_parallel``. Each case runs one
checked step against the golden run, then ``timed_steps`` timed ones (the harness takes each
rank's median and the slowest rank); the two sides alternate ``repeats`` times (DeepSpeed on
fresh ranks each time: it keeps process-global state) and the median of the repeats is
reported. cp=2 by default, so on a 2-core machine each rank has a core. No assertions.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parbench.bench import alternate, base_case, describe, print_ratios  # noqa: E402
from parbench.overrides import apply_overrides  # noqa: E402
from parbench.terminate import run_terminable  # noqa: E402

PAIRS = [("context.ulysses", "baseline.deepspeed.ulysses"),
         ("context.ring-attention", "baseline.torch.context_parallel")]
DEFAULTS = {"model": "small", "seq_length": "256", "cp": "2", "steps": "1",
            "timed_steps": "8", "warmup_steps": "2", "num_microbatches": "1",
            "micro_batch_size": "2", "cp_balance": "zigzag",
            # AdamW turns reduction noise in gradients of the order of eps into parameter
            # differences up to lr: see PARAM_ATOL in tests/equivalence/test_context.py
            "param_atol": "1e-3"}


def main(argv: list[str]) -> None:
    base, repeats = base_case(argv, DEFAULTS)
    schemes = [s for pair in PAIRS for s in pair]
    started = time.time()
    rows = alternate({s: apply_overrides(base, {"scheme": s}) for s in schemes}, repeats)
    print("\n" + describe(base, repeats, started) + f", cp={base.layout.cp}")
    print_ratios(rows, PAIRS)


if __name__ == "__main__":
    sys.exit(run_terminable(main, sys.argv[1:], prog="bench_context",
                           kept="the lines printed above are what it measured"))
