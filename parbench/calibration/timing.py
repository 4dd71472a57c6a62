"""Timing on the calibration ranks: synchronised, repeated measurements (slowest rank counts),
paired differences, and the model's own layers at the rank's local shapes
(``local_model``)."""
from __future__ import annotations

import statistics
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..comm import unrecorded
from ..device import StepTimer, synchronize
from .local_model import local_modules, vocab_shard
from .plan import Plan, gated_mlp, kv_width
from .reentry import graph_counts


def sync(device: str) -> None:
    """Wait for the device's queued work (``parbench.device.synchronize``)."""
    synchronize(device)


def sample_seconds(fn: Callable[[], Any], k: int, device: str) -> float:
    """Seconds per call of ``fn`` over ``k`` calls after a barrier: on CUDA timed by events
    on the device, synchronised at the end; on CPU by the host's clock
    (``parbench.device.StepTimer``)."""
    barrier()
    timer = StepTimer(device).start()
    for _ in range(k):
        fn()
    return timer.stop() / k


def _dist_ready() -> bool:
    return dist.is_available() and dist.is_initialized()


def agree_max(x: float, device: str) -> float:
    """The largest ``x`` over the ranks (outside any ledger: not the scheme's traffic)."""
    if not _dist_ready():
        return x
    t = torch.tensor([x], dtype=torch.float64, device=device)
    with unrecorded():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def barrier() -> None:
    if _dist_ready():
        with unrecorded():
            dist.barrier()


def timeit(fn: Callable[[], Any], device: str, min_time: float, repeats: int) -> float:
    """Median seconds per call of ``fn`` (k calls per sample, k so a sample lasts min_time).

    On ranks every rank runs the same k at the same time, samples started together after a
    barrier, so the figure includes what sharing the machine costs (cores, caches, memory
    bandwidth) as a run's ranks share it."""
    fn()
    k = _calls_per_sample(fn, device, min_time)
    samples = [sample_seconds(fn, k, device) for _ in range(repeats)]
    return statistics.median(samples)


def _calls_per_sample(fn: Callable[[], Any], device: str, min_time: float) -> int:
    """How many calls of ``fn`` make a sample of at least ``min_time`` (the slowest rank's
    single call decides, so every rank runs the same number)."""
    sync(device)
    timer = StepTimer(device).start()
    fn()
    one = agree_max(max(timer.stop(), 1e-7), device)
    return max(1, min(10000, int(min_time / one)))


def _paired(base: Callable[[], Any], more: Callable[[], Any], device: str, min_time: float,
            repeats: int) -> tuple[float, float]:
    """(t_base, t_more - t_base) per call, from samples of ``base`` and ``more`` taken in
    turn (k calls each, the same k on every rank, after a barrier) and the median of the
    paired differences: a machine whose load drifts shifts both halves of a pair alike."""
    base()
    more()
    k = _calls_per_sample(more, device, min_time)
    bases, diffs = [], []
    for _ in range(max(3, repeats)):
        pair = [sample_seconds(fn, k, device) for fn in (base, more)]
        bases.append(pair[0])
        diffs.append(pair[1] - pair[0])
    return statistics.median(bases), statistics.median(diffs)


def dtype_of(name: str):
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def time_parts(plan: Plan, dev: str, dt: str) -> list[dict]:
    """The reference model's in-graph costs at each (b, s/cp, tp), by regression over depth:
    the local model (embedding, k layers, head and loss) timed forward and forward + backward
    at k = 1 and k = 3; a layer costs the slope, the embedding, head, loss and ``backward()``
    call together (``ends``) the intercept. Timing a layer alone would miss what chaining
    costs (the gradient flowing between layers)."""
    sh = plan.shape
    dtype = dtype_of(dt)
    out = []
    mods: dict[int, tuple] = {}
    graphs: dict[int, dict] = {}
    k1, k2 = 1, 3
    for b, s_l, tp in plan.layer_shapes():
        if tp not in mods:
            mods[tp] = tuple(m.to(dev) for m in local_modules(sh, tp, dtype))
        layer, head, embed = mods[tp]
        if tp not in graphs:  # the layer's graph is the same at every (b, s)
            graphs[tp] = graph_counts(layer, embed(torch.randint(0, vocab_shard(sh, tp),
                                                                 (1, sh.s), device=dev)))
        vl = vocab_shard(sh, tp)
        tokens = torch.randint(0, vl, (b, s_l), device=dev)
        targets = torch.randint(0, vl, (b, s_l), device=dev)

        def fwd(k):
            def run():
                x = embed(tokens)
                for _ in range(k):
                    x = layer(x)
                return head(x, targets)
            return run

        def fwd_bwd(k):
            f_ = fwd(k)
            return lambda: f_().backward()

        t1f, dfw = _paired(fwd(k1), fwd(k2), dev, plan.min_time_s, plan.repeats)
        t1fb, dfb = _paired(fwd_bwd(k1), fwd_bwd(k2), dev, plan.min_time_s, plan.repeats)
        lf = max(dfw / (k2 - k1), 0.0)
        lfb = max(dfb / (k2 - k1), lf)
        ef = max(t1f - k1 * lf, 0.0)
        efb = max(t1fb - k1 * lfb, ef)
        row = {"b": b, "s": s_l, "tp": tp, "h": sh.h, "heads": sh.a // tp, "f": sh.f // tp,
               "kv": kv_width(sh) // tp, "vocab": vl, "dtype": dt, "gated": gated_mlp(sh)}
        out.append({"kind": "layer", **row, "fwd_s": lf, "bwd_s": lfb - lf, **graphs[tp]})
        out.append({"kind": "ends", **row, "fwd_s": ef, "bwd_s": efb - ef})
        for m_ in (layer, head, embed):
            m_.zero_grad(set_to_none=True)
    return out
