"""What the committed golden files save: per suite, the golden run trained here ("live")
against the same run served from its golden file (read, sha256, optimizer replayed), both
alternately in this one process, CPU time on one thread; prints each median, the ratio, and
the suite's golden requests (one per rank and one in the parent per case: the most a run of
the suite can save, before the per-process cache shares a key between cases).

    python scripts/bench_golden.py [suite=a,b] [repeats=5]
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from parbench import golden  # noqa: E402
from parbench.cli.inspect import golden_cases  # noqa: E402
from parbench.overrides import parse_overrides  # noqa: E402
from parbench.registry import routing_of  # noqa: E402


def cpu_seconds(fn) -> float:
    t = time.process_time()
    fn()
    return time.process_time() - t


def time_key(w, repeats: int) -> tuple[float, float]:
    """Median CPU seconds of the live run and of the served one, alternately."""
    live, served = [], []
    golden.train(w.case, 1, w.routing)  # warm-up: the first optimizer imports torch._dynamo
    for _ in range(repeats):
        live.append(cpu_seconds(lambda: golden.train(w.case, w.steps, w.routing)))
        served.append(cpu_seconds(lambda: golden.train(
            w.case, w.steps, w.routing, golden.stored(w.key, golden.GOLDEN_DIR))))
    return statistics.median(live), statistics.median(served)


def main(argv: list[str]) -> None:
    ov = parse_overrides(argv)
    repeats = int(ov.get("repeats", 5))
    names = [n for n in str(ov.get("suite", "")).split(",") if n] or None
    torch.set_num_threads(1)
    by_suite = golden_cases(names)
    stored = {e["key"] for e in golden.read_manifest(golden.GOLDEN_DIR).values()}
    print(f"{'suite':9s} {'key':15s} {'cases':>5s} {'requests':>8s} {'live ms':>8s} "
          f"{'served ms':>9s} {'ratio':>6s} {'saved s (at most)':>17s}")
    for suite, cases in by_suite.items():
        total = 0.0
        for w in golden.select_runs({suite: cases}, routing_of, "all"):
            if w.key not in stored:
                continue
            users = [c for c in cases if golden.golden_key(
                c, routing_of(c) if c.model.num_experts else None) == w.key]
            requests = sum(c.layout.world_size + 1 for c in users)
            live, served = time_key(w, repeats)
            total += requests * (live - served)
            print(f"{suite:9s} {golden.golden_name(w.key):15s} {len(users):5d} {requests:8d} "
                  f"{live * 1e3:8.1f} {served * 1e3:9.1f} {live / served:6.1f} "
                  f"{requests * (live - served):17.2f}")
        print(f"{suite:9s} {'(suite)':15s} {len(cases):5d} {'':8s} {'':8s} {'':9s} {'':6s} "
              f"{total:17.2f}")


if __name__ == "__main__":
    main(sys.argv[1:])
