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

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parbench.bench import alternate, base_case, describe, print_ratios  # noqa: E402
from parbench.overrides import apply_overrides, parse_overrides  # noqa: E402
from parbench.terminate import run_terminable  # noqa: E402

#: (ours, torch's, vpp)
PAIRS = [("pipeline.1f1b", "baseline.torch.pipelining.1f1b", 1),
         ("pipeline.interleaved", "baseline.torch.pipelining.interleaved", 2),
         ("pipeline.zbv", "baseline.torch.pipelining.zbv", 2),
         ("pipeline.dualpipev", "baseline.torch.pipelining.dualpipev", 2)]
DEFAULTS = {"model": "small", "num_layers": "8", "pp": "2", "steps": "1",
            "timed_steps": "8", "warmup_steps": "2", "num_microbatches": "8",
            "micro_batch_size": "1"}
BUBBLE_SCHEMES = ("pipeline.1f1b", "pipeline.pipedream", "pipeline.2bw")
BUBBLE_FIELDS = ("measured", "replayed", "unit", "closed_form")


def bubbles(argv: list[str]) -> None:
    """The flushing and the continuous pipelines' bubbles side by side, per pp."""
    ov = {**DEFAULTS, **parse_overrides(argv)}
    degrees = [int(x) for x in str(ov.pop("pp", "2,4")).split(",")]
    for key in ("repeats", "schedules", "mode"):
        ov.pop(key, None)
    print(f"{'pp':>3s} {'scheme':22s} " + " ".join(f"{k:>12s}" for k in BUBBLE_FIELDS)
          + "  held graphs            verdict")
    for pp in degrees:
        base, _ = base_case([f"{k}={v}" for k, v in ov.items()], {"pp": str(pp)})
        rows = alternate({s: apply_overrides(base, {"scheme": s}) for s in BUBBLE_SCHEMES}, 1,
                         verbose=False)
        for scheme, (row,) in rows.items():
            bubble = row.pipeline
            values = [getattr(bubble, k) if bubble else None for k in BUBBLE_FIELDS]
            cells = " ".join("           —" if v is None else f"{v:12.3f}" for v in values)
            held = bubble.held_graphs if bubble else ""
            print(f"{pp:3d} {scheme:22s} {cells}  {held:22s} "
                  f"{'pass' if row.passed else 'FAIL'}", flush=True)
    m = base.model
    print(f"\nmodel={m.name} (h={m.hidden_size}, layers={m.num_layers}, seq={m.seq_length}), "
          f"m={base.layout.num_microbatches}, {base.run.timed_steps} timed steps "
          "(measured: median over the steady ones), device "
          f"{base.run.device}; unit: T_F = T_B = T_W = 1")


def main(argv: list[str]) -> None:
    ov = parse_overrides(argv)
    if ov.pop("mode", "pairs") == "bubbles":
        return bubbles([f"{k}={v}" for k, v in ov.items()])
    only = ov.pop("schedules", "")
    pairs = [pr for pr in PAIRS if not only or pr[0].split(".", 1)[1] in only.split(",")]
    base, repeats = base_case([f"{k}={v}" for k, v in ov.items()], DEFAULTS)
    cases = {}
    for ours, theirs, vpp in pairs:
        for s in (ours, theirs):
            cases[s] = apply_overrides(base, {"scheme": s, "vpp": str(vpp)})
    started = time.time()
    rows = alternate(cases, repeats)
    print("\n" + describe(base, repeats, started))
    print_ratios(rows, [(ours, theirs) for ours, theirs, _ in pairs])


if __name__ == "__main__":
    sys.exit(run_terminable(main, sys.argv[1:], prog="bench_pipeline",
                           kept="the lines printed above are what it measured"))
