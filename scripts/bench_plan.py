"""Benchmark ``parbench plan``: per preset and world size, the layouts considered (the rules
accept them), the layouts priced (lower bound or simulation) and the CPU seconds of the
search (``time.process_time``, median of the repeats; every repeat starts from cold caches).

    python scripts/bench_plan.py                       # every preset, worlds 1024 and 16384
    python scripts/bench_plan.py --presets mixtral-8x7b --worlds 64 --repeats 1
"""
from __future__ import annotations

import argparse
import statistics
import time


def _cold() -> None:
    """Forget every cache the planner and the time model fill, so a repeat costs what a
    fresh ``parbench plan`` costs."""
    import functools
    import gc
    import sys
    from parbench.timemodel import dp_memory
    dp_memory._STAGES.clear()
    dp_memory._MEMORY.clear()
    for mod in list(sys.modules.values()):
        if not getattr(mod, "__name__", "").startswith("parbench"):
            continue
        for obj in list(vars(mod).values()):
            if isinstance(obj, functools._lru_cache_wrapper):
                obj.cache_clear()
    gc.collect()


def run(preset: str, world: int, device: str, repeats: int) -> dict:
    from parbench.analytic.shape import shape_from
    from parbench.config import model_preset
    from parbench.plan import plan
    from parbench.timemodel import load_profile
    times, res = [], None
    for _ in range(repeats):
        _cold()
        profile = load_profile(device)  # a fresh profile: an empty pricing cache
        shape = shape_from(model_preset(preset))
        t0 = time.process_time()
        res = plan(shape, world, profile, world)
        times.append(time.process_time() - t0)
    fit = res.evaluated - res.over_memory
    return {"preset": preset, "world": world, "considered": res.evaluated,
            "over_memory": res.over_memory, "fit": fit,
            "priced": res.bounded, "bounded": res.bounded,
            "simulated": res.simulated, "skipped": res.skipped,
            "cpu_s": statistics.median(times),
            "best": res.ranked[0][1].step_s if res.ranked else None}


def main() -> None:
    from parbench.config import PRESETS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="*", default=sorted(PRESETS))
    ap.add_argument("--worlds", nargs="*", type=int, default=[1024, 16384])
    ap.add_argument("--device", default="h100")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    cols = ("preset", "world", "considered", "over_memory", "priced", "simulated",
            "skipped", "cpu_s", "best")
    print(" ".join(f"{c:>16}" if i == 0 else f"{c:>11}" for i, c in enumerate(cols)))
    for preset in args.presets:
        for world in args.worlds:
            try:
                r = run(preset, world, args.device, args.repeats)
            except Exception as exc:  # noqa: BLE001 - a preset the model refuses: say so
                print(f"{preset:>16} {world:>11} error: {exc}", flush=True)
                continue
            cells = [f"{r['preset']:>16}"] + [f"{r[c]:>11}" for c in cols[1:7]]
            cells.append(f"{r['cpu_s']:>11.2f}")
            cells.append(f"{r['best']:>11.4g}" if r["best"] is not None else f"{'none':>11}")
            print(" ".join(cells), flush=True)


if __name__ == "__main__":
    main()
