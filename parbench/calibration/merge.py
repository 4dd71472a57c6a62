"""The ranks' raw measurements made into a :class:`~parbench.timemodel.profile.Profile`: the
slowest rank per figure, and for each collective the fit ``t = alpha + beta S``."""
from __future__ import annotations

import os
import platform
import time

import torch

from ..timemodel.profile import Fit, Link, Profile
from .plan import Plan


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


def slowest_compute(comp: list[dict]) -> tuple[dict, dict, dict]:
    """(GEMM seconds by (m, n, k, dtype), attention (fwd, bwd) seconds by shape, layer parts
    by shape): the slowest rank's figure of each."""
    gemms: dict[tuple, float] = {}
    attn: dict[tuple, tuple[float, float]] = {}
    parts: dict[tuple, dict] = {}
    for c in comp:
        for g in c["gemms"]:
            key = (g["m"], g["n"], g["k"], g["dtype"])
            gemms[key] = max(gemms.get(key, 0.0), g["seconds"])
        for a in c["attention"]:
            key = (a["b"], a["heads"], a["sq"], a["skv"], a["d"], a["dtype"])
            f0, b0 = attn.get(key, (0.0, 0.0))
            attn[key] = (max(f0, a["fwd_s"]), max(b0, a["bwd_s"]))
        for p in c.get("parts", []):
            key = tuple((k, p[k]) for k in sorted(p) if k not in ("fwd_s", "bwd_s"))
            old = parts.get(key)
            if old is None or p["fwd_s"] + p["bwd_s"] > old["fwd_s"] + old["bwd_s"]:
                parts[key] = p
    return gemms, attn, parts


def collective_fits(coll: list[dict], ranks_per_node: int) -> tuple[dict, dict, bool]:
    """(fits[link][op][n], the points fitted by "op:n", whether a send blocks): the slowest
    member's time per point, then the fit; groups within a node are link ``intra``."""
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
    return fits, points, blocking


def links_of(fits: dict) -> dict[str, Link]:
    """Each link's one-way bandwidth and latency: from send/recv, else from the smallest
    all-reduce group (ring: 2 (n-1)/n of the message crosses each link, 2 (n-1) latencies)."""
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
    return links


def device_memory(plan: Plan, world_size: int) -> float:
    """Bytes of memory per rank: the GPU's, or the machine's shared by the ranks (0 unknown)."""
    try:
        if plan.device.startswith("cuda"):
            return float(torch.cuda.get_device_properties(0).total_memory)
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / max(world_size, 1)
    except (ValueError, OSError, AttributeError):
        return 0.0


def profile_meta(plan: Plan, world_size: int, points: dict, extra: dict | None) -> dict:
    """Where and how the profile was measured."""
    meta = {"host": platform.node(), "cpus": os.cpu_count(), "world_size": world_size,
            "threads_per_rank": 1, "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "instrumented": plan.instrumented,
            "collective_points": points,
            "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None}
    if plan.shape is not None:
        meta["shape"] = {k: getattr(plan.shape, k) for k in (
            "vocab_size", "hidden_size", "num_layers", "num_heads", "seq_length",
            "ffn_hidden_size")}
    meta.update(extra or {})
    return meta


def build_profile(name: str, plan: Plan, compute: list[dict], coll: list[dict],
                  overlap: float, world_size: int, ranks_per_node: int,
                  extra_meta: dict | None = None) -> Profile:
    """Turn the ranks' raw measurements into a profile (slowest rank per figure)."""
    comp = [c for c in compute if c is not None]
    gemms, attn, parts = slowest_compute(comp)
    peak: dict[str, float] = {}
    for (m, n, k, dt), sec in gemms.items():
        peak[dt] = max(peak.get(dt, 0.0), 2.0 * m * n * k / sec)
    fits, points, blocking = collective_fits(coll, ranks_per_node)
    meta = profile_meta(plan, world_size, points, extra_meta)
    cuda = plan.device.startswith("cuda")
    return Profile(
        name=name, device="cuda" if cuda else "cpu",
        description=f"measured by parbench calibrate on {platform.node()} ({world_size} "
                    f"ranks, {'NCCL' if cuda else 'gloo, 1 thread per rank'})",
        calibrated=True,
        source=f"parbench calibrate, {meta['date']}; slowest rank's medians",
        memory_bytes=device_memory(plan, world_size), matmul_flops=peak,
        mem_bandwidth=min(c["mem_bandwidth"] for c in comp),
        op_overhead_s=max(c["op_overhead_s"] for c in comp),
        bwd_op_overhead_s=max(c["bwd_op_overhead_s"] for c in comp),
        backward_call_s=max(c["backward_call_s"] for c in comp),
        grad_reentry_s=max(c["grad_reentry_s"] for c in comp),
        graph_walk_s=max(c["graph_walk_s"] for c in comp),
        gemms=[{"m": m, "n": n, "k": k, "dtype": dt, "seconds": s}
               for (m, n, k, dt), s in sorted(gemms.items())],
        attention=[{"b": b, "heads": hh, "sq": sq, "skv": skv, "d": d, "dtype": dt,
                    "fwd_s": f, "bwd_s": bb}
                   for (b, hh, sq, skv, d, dt), (f, bb) in sorted(attn.items())],
        parts=list(parts.values()),
        optimizer={"per_tensor_s": max(c["optimizer"]["per_tensor_s"] for c in comp),
                   "per_element_s": max(c["optimizer"]["per_element_s"] for c in comp)},
        ranks_per_node=ranks_per_node, links=links_of(fits), collectives=fits,
        overlap=overlap, p2p_blocking=blocking, meta=meta)
