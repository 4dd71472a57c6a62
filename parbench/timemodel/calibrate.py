"""``parbench calibrate``: measure this machine (or a cluster node) and write a :class:`Profile`.

Every measurement runs on the ranks parbench runs its cases on -- a local ``WorkerPool``
(gloo on CPU with one thread per rank, NCCL on CUDA with one device per rank), or this
process as one rank of a ``torchrun`` / Slurm job -- and on *all ranks at once*, so that the
figures include the contention a real run has (ranks sharing cores, memory bandwidth, a
node's links). Each figure is the median of repeated timings; the slowest rank's median is
kept.

What is measured:

1. **GEMMs** at the model's shapes (when a model is given): for every linear of the reference
   layer (QKV, projection, fc1, fc2, the LM head) at each tensor-parallel split and micro-batch
   size asked for, the forward GEMM and both backward GEMMs (input and weight gradient), plus
   square GEMMs for the peak. Times include the call's fixed cost.
2. **Memory**: a large copy (bandwidth, read + write counted), and the fixed cost of one eager
   operator (a one-element add), of one autograd node in backward and of a ``backward()``
   call (a chain of k scalar multiplies, forward and backward, for two k: the slope and the
   intercept).
3. **Fused attention** (``scaled_dot_product_attention``, causal) forward and backward at the
   model's head shapes, and **AdamW** (``foreach=False``, as parbench runs it) per parameter
   tensor and per element, from two sizes.
4. **Collectives**: all_reduce, all_gather, reduce_scatter, all_to_all on groups of 2..N ranks
   and send/recv between two ranks, each over a sweep of message sizes, fitted with
   ``t = alpha + beta S`` (weighted least squares on the relative error). Each call is issued
   between bursts of a step's compute (the reference layer's forward and backward), the
   burst's own time subtracted: a collective called back to back costs less than one called
   from a busy rank (on a shared CPU, two to three times less). ``instrumented=True`` runs
   them inside a recording ledger with a timeline, as the harness's timed steps do.
5. **Overlap**: an asynchronous all-reduce issued before a GEMM loop of the same length: the
   fraction of the shorter of the two that disappears from the sum.
"""
from __future__ import annotations

from typing import Callable
import os
import platform
import time

from .calibration_plan import Plan
from .profile import COLLECTIVE_OPS, Fit, Link, Profile
from .tasks import collective_task, compute_task, overlap_task, _reference_task


# ---------------------------------------------------------------------------------------
# fitting
# ---------------------------------------------------------------------------------------

def fit_alpha_beta(sizes: list[float], times: list[float]) -> Fit:
    """Least-squares ``t = alpha + beta S`` minimising the relative residuals
    ``(alpha + beta S_i - t_i) / t_i`` (so 4-byte and 16-MB messages weigh alike), with
    alpha, beta >= 0 (a negative one is set to 0 and the other refitted)."""
    if len(sizes) != len(times) or not sizes:
        raise ValueError("fit_alpha_beta needs as many sizes as times, at least one")
    pts = [(float(s), float(t)) for s, t in zip(sizes, times) if t > 0]
    if not pts:
        raise ValueError("fit_alpha_beta needs positive times")
    # rows [1/t, S/t] . [alpha, beta] = 1
    a11 = sum(1 / t ** 2 for s, t in pts)
    a12 = sum(s / t ** 2 for s, t in pts)
    a22 = sum(s * s / t ** 2 for s, t in pts)
    b1 = sum(1 / t for s, t in pts)
    b2 = sum(s / t for s, t in pts)
    det = a11 * a22 - a12 * a12
    alpha = beta = -1.0
    if len(pts) >= 2 and det > 1e-12 * max(a11 * a22, 1e-300):
        alpha = (b1 * a22 - b2 * a12) / det
        beta = (a11 * b2 - a12 * b1) / det
    if alpha < 0 or beta < 0:
        # one-parameter fits; keep the better of the two
        cands = []
        if a22 > 0:
            cands.append((0.0, b2 / a22))
        cands.append((b1 / a11, 0.0))
        alpha, beta = min(cands, key=lambda ab: sum(((ab[0] + ab[1] * s) / t - 1) ** 2
                                                     for s, t in pts))
    err = max(abs((alpha + beta * s) / t - 1) for s, t in pts)
    return Fit(alpha_s=alpha, beta_s_per_byte=beta, points=len(pts), max_rel_err=err)


# ---------------------------------------------------------------------------------------
# what to measure
# ---------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------

def _run_everywhere(fn, world_size: int, device: str, *args) -> list:
    """``fn(ctx, *args)`` on every rank: this process's job under torchrun, else a local
    pool (one thread per rank)."""
    from ..launch import WorkerPool, in_torchrun, init_from_env
    if in_torchrun():
        import torch.distributed as dist
        ctx = init_from_env(device)
        mine = fn(ctx, *args)
        gathered: list = [None] * ctx.world_size
        dist.all_gather_object(gathered, mine)
        return gathered
    with WorkerPool(world_size, device=device, timeout_s=600.0, threads=1,
                    hang_timeout_s=600.0) as pool:
        return pool.run(fn, *args, timeout_s=3600.0, hang_timeout_s=600.0)


def _slowest(per_rank: list[dict], key: str, bigger_is_slower: bool = True):
    vals = [r[key] for r in per_rank if r is not None]
    return max(vals) if bigger_is_slower else min(vals)


def build_profile(name: str, plan: Plan, compute: list[dict], coll: list[dict],
                  overlap: float, world_size: int, ranks_per_node: int,
                  extra_meta: dict | None = None) -> Profile:
    """Turn the ranks' raw measurements into a profile (slowest rank per figure)."""
    comp = [c for c in compute if c is not None]
    gemms: dict[tuple, float] = {}
    for c in comp:
        for g in c["gemms"]:
            key = (g["m"], g["n"], g["k"], g["dtype"])
            gemms[key] = max(gemms.get(key, 0.0), g["seconds"])
    attn: dict[tuple, tuple[float, float]] = {}
    for c in comp:
        for a in c["attention"]:
            key = (a["b"], a["heads"], a["sq"], a["skv"], a["d"], a["dtype"])
            f0, b0 = attn.get(key, (0.0, 0.0))
            attn[key] = (max(f0, a["fwd_s"]), max(b0, a["bwd_s"]))
    parts: dict[tuple, dict] = {}
    for c in comp:
        for p in c.get("parts", []):
            key = tuple((k, p[k]) for k in sorted(p) if k not in ("fwd_s", "bwd_s"))
            old = parts.get(key)
            if old is None or p["fwd_s"] + p["bwd_s"] > old["fwd_s"] + old["bwd_s"]:
                parts[key] = p
    peak: dict[str, float] = {}
    for (m, n, k, dt), sec in gemms.items():
        peak[dt] = max(peak.get(dt, 0.0), 2.0 * m * n * k / sec)
    opt = {"per_tensor_s": max(c["optimizer"]["per_tensor_s"] for c in comp),
           "per_element_s": max(c["optimizer"]["per_element_s"] for c in comp)}
    # collectives: the slowest member's time per point, then the fit
    raw: dict[str, dict[int, float]] = {}
    blocking = any(v for r in coll for _, v in (r or {}).get("send_blocks", []))
    for r in coll:
        for key, pts in (r or {}).items():
            if key == "send_blocks":
                continue
            d = raw.setdefault(key, {})
            for S, t in pts:
                d[S] = max(d.get(S, 0.0), t)
    fits: dict[str, dict[str, dict[int, Fit]]] = {}
    points: dict[str, list] = {}
    for key, pts in sorted(raw.items()):
        op, n = key.split(":")
        n = int(n)
        link = "intra" if n <= ranks_per_node else "inter"
        S, t = zip(*sorted(pts.items()))
        fits.setdefault(link, {}).setdefault(op, {})[n] = fit_alpha_beta(list(S), list(t))
        points[key] = [[s, tt] for s, tt in zip(S, t)]
    links = {}
    for link, ops in fits.items():
        send = ops.get("send", {}).get(2)
        ar = ops.get("all_reduce", {})
        if send is not None:
            links[link] = Link(bandwidth=send.bandwidth, latency_s=send.alpha_s,
                               source="measured send/recv (one way)")
        elif ar:
            n = min(ar)
            f = ar[n]
            links[link] = Link(bandwidth=2 * (n - 1) / n * f.bandwidth,
                               latency_s=f.alpha_s / max(2 * (n - 1), 1),
                               source=f"measured all_reduce on {n} ranks")
    mem = 0.0
    try:
        if plan.device.startswith("cuda"):
            import torch
            mem = float(torch.cuda.get_device_properties(0).total_memory)
        else:
            mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / max(world_size, 1)
    except (ValueError, OSError, AttributeError):
        pass
    import torch
    meta = {"host": platform.node(), "cpus": os.cpu_count(), "world_size": world_size,
            "threads_per_rank": 1, "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "instrumented": plan.instrumented,
            "collective_points": points,
            "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None}
    if plan.shape is not None:
        meta["shape"] = {k: getattr(plan.shape, k) for k in (
            "vocab_size", "hidden_size", "num_layers", "num_heads", "seq_length",
            "ffn_hidden_size")}
    meta.update(extra_meta or {})
    return Profile(
        name=name, device="cuda" if plan.device.startswith("cuda") else "cpu",
        description=f"measured by parbench calibrate on {platform.node()} "
                    f"({world_size} ranks, {'NCCL' if plan.device.startswith('cuda') else 'gloo, 1 thread per rank'})",
        calibrated=True,
        source=f"parbench calibrate, {meta['date']}; slowest rank's medians",
        memory_bytes=mem, matmul_flops=peak,
        mem_bandwidth=min(c["mem_bandwidth"] for c in comp),
        op_overhead_s=max(c["op_overhead_s"] for c in comp),
        bwd_op_overhead_s=max(c["bwd_op_overhead_s"] for c in comp),
        backward_call_s=max(c["backward_call_s"] for c in comp),
        gemms=[{"m": m, "n": n, "k": k, "dtype": dt, "seconds": s}
               for (m, n, k, dt), s in sorted(gemms.items())],
        attention=[{"b": b, "heads": hh, "sq": sq, "skv": skv, "d": d, "dtype": dt,
                    "fwd_s": f, "bwd_s": bb}
                   for (b, hh, sq, skv, d, dt), (f, bb) in sorted(attn.items())],
        parts=list(parts.values()),
        optimizer=opt, ranks_per_node=ranks_per_node, links=links, collectives=fits,
        overlap=overlap, p2p_blocking=blocking, meta=meta)


def calibrate(plan: Plan, world_size: int = 2, name: str | None = None,
              reference: tuple[str, int, int] | None = None,
              progress: Callable[[str], None] | None = None) -> Profile:
    """Measure and return a profile (not saved). ``reference``: (model preset, b, m) of a
    single-rank reference step to time as a check of the compute model."""
    say = progress or (lambda s: None)
    from ..launch import in_torchrun
    if in_torchrun():
        world_size = int(os.environ["WORLD_SIZE"])
        ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    else:
        ranks_per_node = world_size
    t0 = time.time()
    say(f"compute: GEMMs ({len(plan.gemm_shapes()) + len(plan.square_sizes)} shapes), "
        f"attention, memory, overheads, AdamW on {world_size} ranks at once")
    compute = _run_everywhere(compute_task, world_size, plan.device, plan)
    say(f"collectives: {', '.join(COLLECTIVE_OPS)} on groups of "
        f"{', '.join(map(str, plan.group_sizes or range(2, world_size + 1)))} ranks, "
        f"{len(plan.message_bytes)} message sizes ({time.time() - t0:.0f} s so far)")
    coll = _run_everywhere(collective_task, world_size, plan.device, plan)
    say(f"overlap of an all-reduce with a GEMM loop ({time.time() - t0:.0f} s so far)")
    overlap = _run_everywhere(overlap_task, world_size, plan.device, plan)
    extra = {}
    if reference is not None:
        model_name, b, m = reference
        say(f"reference step: {model_name}, {m} micro-batches of {b}, one rank each")
        secs = _run_everywhere(_reference_task, world_size, plan.device, model_name, b, m,
                               plan.min_time_s * 5, plan.repeats)
        extra["reference_step"] = {"model": model_name, "micro_batch_size": b,
                                   "num_microbatches": m, "seconds": max(secs),
                                   "per_rank_s": secs}
    extra["calibration_seconds"] = time.time() - t0
    default = "cuda-local" if plan.device.startswith("cuda") else "cpu-local"
    return build_profile(name or default, plan, compute, coll, min(overlap), world_size,
                         ranks_per_node, extra)
