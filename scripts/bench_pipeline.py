"""Step time of our 1F1B, interleaved, ZB-V and DualPipeV against torch.distributed.pipelining's
on the same case; prints medians and the ratio ours / torch (< 1: ours faster).

    python scripts/bench_pipeline.py [model=small] [num_layers=8] [pp=2] [num_microbatches=8]
                                     [timed_steps=8] [repeats=3] [schedules=1f1b,zbv]
                                     [key=value ...]

With ``mode=bubbles``: the bubbles of 1F1B (flushing every step) beside the continuous
PipeDream and PipeDream-2BW on the same case -- measured over the steady timed steps,
replayed from the measured op costs, simulated with unit costs and the closed form (1F1B:
(p-1)/(m+p-1); the continuous pipelines: one forward ramp per harness step) -- for each
``pp`` of a comma list:

    python scripts/bench_pipeline.py mode=bubbles pp=2,4 [model=small] [timed_steps=8]

Each scheme runs the same case (one checked step against the golden run, then
``timed_steps`` timed ones; the harness takes each rank's median and the slowest rank). The
two sides of a pair run alternately ``repeats`` times on one pool of ranks and the median of
the repeats is reported, so slow drift of a shared machine hits both. By default pp=2, so on a
2-core machine each rank has a core of its own. No assertions: this prints numbers.
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parbench.config import CaseConfig  # noqa: E402
from parbench.overrides import apply_overrides, parse_overrides  # noqa: E402
from parbench.launch import WorkerPool  # noqa: E402
from parbench.runner import run_per_rank  # noqa: E402
from parbench.scheme import get_scheme  # noqa: E402
from parbench.verdict import merge_ranks  # noqa: E402

#: (ours, torch's, vpp)
PAIRS = [("pipeline.1f1b", "baseline.torch.pipelining.1f1b", 1),
         ("pipeline.interleaved", "baseline.torch.pipelining.interleaved", 2),
         ("pipeline.zbv", "baseline.torch.pipelining.zbv", 2),
         ("pipeline.dualpipev", "baseline.torch.pipelining.dualpipev", 2)]
DEFAULTS = {"model": "small", "num_layers": "8", "pp": "2", "steps": "1",
            "timed_steps": "8", "warmup_steps": "2", "num_microbatches": "8",
            "micro_batch_size": "1"}


def run_one(pool: WorkerPool, case: CaseConfig) -> tuple[bool, float, float]:
    """(equivalent, step time in s, p2p bytes sent by all ranks in the checked step)."""
    cls = get_scheme(case.run.scheme)
    cls.check(case)
    per_rank = run_per_rank(case, pool)
    names = sorted(cls.reference(case, 1).params[0])
    merged = merge_ranks(per_rank, names)
    sent = sum(x["wire_bytes"] for r in per_rank for x in r.ledger if x["op"] == "send")
    return merged.equivalent, merged.step_time_s, sent


BUBBLE_SCHEMES = ("pipeline.1f1b", "pipeline.pipedream", "pipeline.2bw")
BUBBLE_KEYS = ("bubble_measured", "bubble_replayed", "bubble_unit", "bubble_closed_form")


def bubbles(ov: dict) -> None:
    """The flushing and the continuous pipelines' bubbles side by side, per pp."""
    degrees = [int(x) for x in str(ov.pop("pp", "2,4")).split(",")]
    ov.pop("repeats", None)
    ov.pop("schedules", None)
    print(f"{'pp':>3s} {'scheme':22s} " + " ".join(f"{k[7:]:>12s}" for k in BUBBLE_KEYS)
          + "  held graphs            golden")
    for pp in degrees:
        base = apply_overrides(CaseConfig(), {**ov, "pp": str(pp)})
        with WorkerPool(base.parallel.world_size) as pool:
            for scheme in BUBBLE_SCHEMES:
                case = apply_overrides(base, {"scheme": scheme})
                cls = get_scheme(scheme)
                cls.check(case)
                per_rank = run_per_rank(case, pool)
                merged = merge_ranks(per_rank, sorted(cls.reference(case, 1).params[0]))
                mx = per_rank[0].metrics
                cells = " ".join("           —" if mx.get(k) is None else f"{mx[k]:12.3f}"
                                 for k in BUBBLE_KEYS)
                print(f"{pp:3d} {scheme:22s} {cells}  {mx.get('held_graphs', ''):22s} "
                      f"{'pass' if merged.equivalent else 'FAIL'}", flush=True)
    m = base.model
    print(f"\nmodel={m.name} (h={m.hidden_size}, layers={m.num_layers}, seq={m.seq_length}), "
          f"m={base.parallel.num_microbatches}, {base.run.timed_steps} timed steps "
          "(measured: median over the steady ones), device "
          f"{base.run.device}; unit: T_F = T_B = T_W = 1")


def main(argv: list[str]) -> None:
    ov = {**DEFAULTS, **parse_overrides(argv)}
    if ov.pop("mode", "pairs") == "bubbles":
        return bubbles(ov)
    repeats = int(ov.pop("repeats", 3))
    only = ov.pop("schedules", "")
    pairs = [pr for pr in PAIRS if not only or pr[0].split(".", 1)[1] in only.split(",")]
    base = apply_overrides(CaseConfig(), ov)
    times: dict[str, list[float]] = {}
    ok: dict[str, bool] = {}
    sent: dict[str, float] = {}
    t0 = time.time()
    with WorkerPool(base.parallel.world_size) as pool:
        for rep in range(repeats):
            for ours, theirs, vpp in pairs:
                for s in (ours, theirs) if rep % 2 == 0 else (theirs, ours):
                    case = apply_overrides(base, {"scheme": s, "vpp": vpp})
                    equivalent, step_time_s, sent_bytes = run_one(pool, case)
                    times.setdefault(s, []).append(step_time_s)
                    ok[s] = ok.get(s, True) and equivalent
                    sent[s] = sent_bytes
                    print(f"  repeat {rep + 1}/{repeats} {s:40s} "
                          f"{step_time_s * 1e3:8.2f} ms  p2p sent "
                          f"{sent_bytes / 2**10:8.1f} KiB  "
                          f"{'pass' if equivalent else 'FAIL'}", flush=True)
    med = {s: statistics.median(v) for s, v in times.items()}
    m, p = base.model, base.parallel
    print(f"\ncase: model={m.name} (h={m.hidden_size}, layers={m.num_layers}, "
          f"seq={m.seq_length}), pp={p.pp}, micro-batches={p.num_microbatches}x"
          f"{p.micro_batch_size}, {base.run.timed_steps} timed steps x {repeats} repeats, "
          f"device={base.run.device} ({time.time() - t0:.0f} s)")
    print(f"{'scheme':42s} {'median step ms':>15s} {'p2p KiB*':>9s}  golden")
    for ours, theirs, _ in pairs:
        for s in (ours, theirs):
            print(f"{s:42s} {med[s] * 1e3:15.2f} {sent[s] / 2**10:9.1f}  "
                  f"{'pass' if ok[s] else 'FAIL'}")
    print("* point-to-point bytes sent by all ranks in the checked step (step 0: includes "
          "torch's one-time warm-up and metadata messages)")
    print()
    for ours, theirs, _ in pairs:
        r = med[ours] / med[theirs]
        print(f"ratio {ours} / {theirs}: {r:.2f}x  ({'ours faster' if r < 1 else 'ours slower'})")


if __name__ == "__main__":
    main(sys.argv[1:])
