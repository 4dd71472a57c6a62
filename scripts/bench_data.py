"""Step time of native ZeRO-3 against DeepSpeed ZeRO-3 and FSDP2, and of native DDP against
torch DDP, on the same case; prints medians and the ratio ours / baseline (< 1: ours faster).

    python scripts/bench_data.py [model=small] [dp=2] [timed_steps=10] [repeats=3] [key=value ...]

Every scheme runs the same case (one checked step against the golden run, then
``timed_steps`` timed ones; the harness takes each rank's median and the slowest rank). The
pairs are run alternately ``repeats`` times and the median of the repeats is reported, so slow
drift of a shared machine hits both sides. DeepSpeed runs on a fresh pool of ranks each time
(its process-global state); the others share one pool. No assertions: this prints numbers.
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parbench.config import CaseConfig, apply_overrides, parse_overrides  # noqa: E402
from parbench.harness import merge_ranks, run_case  # noqa: E402
from parbench.launch import WorkerPool  # noqa: E402
from parbench.scheme import get_scheme  # noqa: E402

PAIRS = [("zero.3", "baseline.torch.fsdp2"), ("zero.3", "baseline.deepspeed.zero3"),
         ("data.ddp", "baseline.torch.ddp")]
DEFAULTS = {"model": "small", "dp": "2", "steps": "1", "timed_steps": "10",
            "warmup_steps": "2", "num_microbatches": "2", "micro_batch_size": "2",
            "bucket_mb": "1", "param_atol": "1e-4"}


def run_one(pool: WorkerPool | None, case: CaseConfig) -> dict:
    cls = get_scheme(case.run.scheme)
    cls.check(case)
    if cls.isolated or pool is None:
        with WorkerPool(case.parallel.world_size) as fresh:
            per_rank = fresh.run(run_case, case.to_dict(), timeout_s=600)
    else:
        per_rank = pool.run(run_case, case.to_dict(), timeout_s=600)
    return merge_ranks(per_rank)


def main(argv: list[str]) -> None:
    ov = {**DEFAULTS, **parse_overrides(argv)}
    repeats = int(ov.pop("repeats", 3))
    base = apply_overrides(CaseConfig(), ov)
    schemes = sorted({s for pair in PAIRS for s in pair})
    times: dict[str, list[float]] = {s: [] for s in schemes}
    ok: dict[str, bool] = {s: True for s in schemes}
    t0 = time.time()
    with WorkerPool(base.parallel.world_size) as pool:
        for rep in range(repeats):
            for s in schemes:
                case = apply_overrides(base, {"scheme": s})
                merged = run_one(pool, case)
                times[s].append(merged["step_time_s"])
                ok[s] = ok[s] and merged["equivalent"]
                print(f"  repeat {rep + 1}/{repeats} {s:28s} {merged['step_time_s'] * 1e3:8.2f} ms"
                      f"  wire dp {merged['wire_by_axis'][0].get('dp', 0) / 2**10:9.1f} KiB"
                      f"  {'pass' if merged['equivalent'] else 'FAIL'}", flush=True)
    med = {s: statistics.median(v) for s, v in times.items()}
    m, p = base.model, base.parallel
    print(f"\ncase: model={m.name} (h={m.hidden_size}, layers={m.num_layers}, seq={m.seq_length}),"
          f" dp={p.dp}, micro-batches={p.num_microbatches}x{p.micro_batch_size},"
          f" bucket_mb={p.bucket_mb}, dtype={base.run.dtype}, {base.run.timed_steps} timed"
          f" steps x {repeats} repeats ({time.time() - t0:.0f} s)")
    print(f"{'scheme':30s} {'median step ms':>15s}  golden")
    for s in schemes:
        print(f"{s:30s} {med[s] * 1e3:15.2f}  {'pass' if ok[s] else 'FAIL'}")
    print()
    for ours, theirs in PAIRS:
        r = med[ours] / med[theirs]
        print(f"ratio {ours} / {theirs}: {r:.2f}x  ({'ours faster' if r < 1 else 'ours slower'})")


if __name__ == "__main__":
    main(sys.argv[1:])
