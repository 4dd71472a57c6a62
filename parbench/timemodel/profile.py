"""Device profiles: what one device computes and how fast its links move bytes.

A :class:`Profile` is what the time model (:mod:`.model`) reads. It comes either from
``parbench calibrate`` (measured on this machine or on a cluster node, ``calibrated=True``) or
from a preset written from a vendor's published specification (``calibrated=False``: peak
figures, never reached in practice, so predicted step times are lower bounds and MFU upper
bounds until the device is calibrated).

Fields (SI units: seconds, bytes, FLOP/s, bytes/s):

- ``matmul_flops``: dense matrix-multiply throughput per dtype (``fp32``, ``bf16``); measured:
  the best of the square GEMMs timed by ``calibrate``; preset: the datasheet's dense peak;
- ``gemms``: measured GEMMs ``{"m", "n", "k", "dtype", "seconds"}`` (C[m,n] = A[m,k] B[k,n]),
  at the model's own shapes when ``calibrate`` was given a model; the model interpolates the
  achieved rate in log(FLOPs) between them (:meth:`Profile.gemm_time`);
- ``mem_bandwidth``: bytes/s of a large copy (read + write counted), ``op_overhead_s``: the
  fixed cost of one eager operator, ``bwd_op_overhead_s``: of one autograd node in backward,
  ``backward_call_s``: of one ``loss.backward()`` call;
- ``attention``: measured fused-attention kernels ``{"b", "heads", "sq", "skv", "d",
  "dtype", "fwd_s", "bwd_s"}``;
- ``parts``: the reference model's in-graph costs at each rank's local shape, ``kind``
  ``layer`` (one transformer layer) and ``ends`` (embedding, head, loss and the ``backward()``
  call), from timing the local model at two depths ``{"kind", "b", "s", "tp", "h", "heads",
  "f", "kv", "vocab", "dtype", "fwd_s", "bwd_s"}`` (``calibrate model=...``); the time model
  uses them where the shape matches and scales its operator count by their ratio elsewhere;
- ``optimizer``: AdamW's cost ``{"per_tensor_s", "per_element_s"}`` (single-tensor
  ``torch.optim.AdamW``, as parbench runs it, on CPU; a fused multi-tensor kernel on GPUs);
- ``links``: name -> :class:`Link` (``intra``: inside a node, ``inter``: between nodes) with a
  per-rank one-direction bandwidth and a per-step latency; ``ranks_per_node`` says which
  groups stay inside a node;
- ``collectives``: measured α-β fits ``{link: {op: {group_size: Fit}}}``: one call of ``op``
  with an S-byte message (the ledger's message convention: the all-reduced buffer, the gathered
  output, the reduce-scatter's input, one rank's all-to-all send buffer, the sent tensor) takes
  ``alpha_s + beta_s_per_byte * S``. Where no fit exists for a group size the link's ring model
  is used: ``(n-1) steps x latency + wire_bytes / bandwidth``;
- ``overlap``: the fraction of communication that can be hidden under computation when a scheme
  overlaps them (1 on GPUs with their own copy engines; measured by ``calibrate`` on CPU, where
  gloo's thread and the compute share a core);
- ``p2p_blocking``: a send returns only once its receive is posted (gloo on CPU: measured by
  ``calibrate`` with a receive posted late); the sender is then busy for the transfer, and a
  ring's hops cannot hide under the attention blocks;
- ``memory_bytes``: the device's memory (the host's RAM per rank on CPU).
"""
from __future__ import annotations

import json
import math
import os
from bisect import bisect_left
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..config import ConfigError

#: where ``parbench calibrate`` writes by default, and where ``load_profile`` looks up names
PROFILE_DIR_ENV = "PARBENCH_PROFILE_DIR"
COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send")


def profile_dir() -> Path:
    """``$PARBENCH_PROFILE_DIR``, else ``~/.cache/parbench/profiles``."""
    env = os.environ.get(PROFILE_DIR_ENV)
    return Path(env) if env else Path.home() / ".cache" / "parbench" / "profiles"


@dataclass
class Fit:
    """``t(S) = alpha_s + beta_s_per_byte * S`` for one op and group size, from a sweep of
    message sizes (weighted least squares on relative error); ``max_rel_err`` is the largest
    relative residual over the sweep."""

    alpha_s: float
    beta_s_per_byte: float
    points: int = 0
    max_rel_err: float = 0.0

    def time(self, message_bytes: float) -> float:
        return self.alpha_s + self.beta_s_per_byte * message_bytes

    @property
    def bandwidth(self) -> float:
        """Bytes of message per second at large S (1/beta)."""
        return 1.0 / self.beta_s_per_byte if self.beta_s_per_byte > 0 else math.inf


@dataclass
class Link:
    """A class of connection: per-rank bandwidth in one direction (bytes/s) and the latency of
    one step of a ring or one point-to-point message (s)."""

    bandwidth: float
    latency_s: float
    source: str = ""


#: per-rank bytes one rank sends per message byte, ring algorithms (parbench.analytic.comm)
def wire_factor(op: str, n: int) -> float:
    if n <= 1:
        return 1.0 if op == "send" else 0.0
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0  # send, broadcast


def ring_steps(op: str, n: int) -> int:
    """Latency terms of a ring algorithm: 2(n-1) for all-reduce, n-1 for the others, 1 send."""
    if op == "send":
        return 1
    if n <= 1:
        return 0
    return 2 * (n - 1) if op == "all_reduce" else n - 1


@dataclass
class Profile:
    name: str
    device: str = "cpu"
    description: str = ""
    calibrated: bool = False
    source: str = ""
    memory_bytes: float = 0.0
    matmul_flops: dict[str, float] = field(default_factory=dict)
    mem_bandwidth: float = 0.0
    op_overhead_s: float = 0.0
    bwd_op_overhead_s: float = 0.0
    backward_call_s: float = 0.0
    gemms: list[dict] = field(default_factory=list)
    attention: list[dict] = field(default_factory=list)
    parts: list[dict] = field(default_factory=list)
    optimizer: dict[str, float] = field(default_factory=dict)
    ranks_per_node: int = 8
    links: dict[str, Link] = field(default_factory=dict)
    collectives: dict[str, dict[str, dict[int, Fit]]] = field(default_factory=dict)
    overlap: float = 1.0
    p2p_blocking: bool = False
    meta: dict[str, Any] = field(default_factory=dict)

    # ---- derived lookups (cached per instance) -----------------------------------------
    def __post_init__(self) -> None:
        self._rates: dict[str, tuple[list[float], list[float]]] = {}
        self._exact: dict[tuple, float] = {}
        for g in self.gemms:
            key = (int(g["m"]), int(g["n"]), int(g["k"]), g.get("dtype", "fp32"))
            self._exact[key] = float(g["seconds"])
        by_dtype: dict[str, list[tuple[float, float]]] = {}
        for (m, n, k, dt), sec in self._exact.items():
            fl = 2.0 * m * n * k
            if sec > 0:
                by_dtype.setdefault(dt, []).append((math.log(fl), fl / sec))
        for dt, pts in by_dtype.items():
            pts.sort()
            self._rates[dt] = ([p[0] for p in pts], [p[1] for p in pts])
        self._parts: dict[tuple, tuple[float, float]] = {}
        for p in self.parts:
            self._parts[self._part_key(p["kind"], p)] = (p["fwd_s"], p["bwd_s"])
        self._attn = {(a["b"], a["heads"], a["sq"], a["skv"], a["d"], a.get("dtype", "fp32")):
                      (a["fwd_s"], a["bwd_s"]) for a in self.attention}

    # ---- compute ------------------------------------------------------------------------
    def peak_flops(self, dtype: str) -> float:
        """The dense matmul peak for ``dtype`` (fp16 reads bf16; a dtype not listed reads the
        best one listed)."""
        if dtype in self.matmul_flops:
            return self.matmul_flops[dtype]
        if dtype == "fp16" and "bf16" in self.matmul_flops:
            return self.matmul_flops["bf16"]
        return max(self.matmul_flops.values()) if self.matmul_flops else 1e12

    def gemm_rate(self, flops: float, dtype: str) -> float:
        """Achieved FLOP/s of a GEMM of ``flops``: interpolated in log(FLOPs) between the
        measured GEMMs of that dtype (clamped at both ends), else the peak."""
        table = self._rates.get(dtype)
        if table is None and dtype in ("bf16", "fp16") and "fp32" in self._rates \
                and "bf16" not in self._rates and self.calibrated:
            table = self._rates["fp32"]
        if not table:
            return self.peak_flops(dtype)
        xs, ys = table
        x = math.log(max(flops, 1.0))
        if x <= xs[0]:
            return ys[0] * math.exp(x - xs[0])  # fixed cost dominates below the table
        if x >= xs[-1]:
            return ys[-1]
        i = bisect_left(xs, x)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        w = (x - x0) / (x1 - x0) if x1 > x0 else 0.0
        return y0 + w * (y1 - y0)

    def gemm_time(self, m: int, n: int, k: int, dtype: str) -> float:
        """Seconds of C[m,n] = A[m,k] B[k,n]: the measured time when this exact GEMM was
        timed, else FLOPs over the interpolated rate (measured profiles: includes the call's
        fixed cost), else over the peak plus one operator's overhead."""
        t = self._exact.get((m, n, k, dtype))
        if t is not None:
            return t
        flops = 2.0 * m * n * k
        if self._rates.get(dtype) or (self.calibrated and self._rates):
            return flops / self.gemm_rate(flops, dtype)
        return self.op_overhead_s + flops / self.peak_flops(dtype)

    def attention_time(self, b: int, heads: int, sq: int, skv: int, d: int, dtype: str,
                       causal: bool = True) -> tuple[float, float]:
        """(forward, backward) seconds of one fused attention kernel: measured when timed at
        this shape, else as GEMMs of 4 b heads sq skv d FLOPs forward (QK^T and AV) and
        2.5x that backward (the scores recomputed), halved when causal (masked blocks are
        skipped), plus one operator's overhead each way."""
        hit = self._attn.get((b, heads, sq, skv, d, dtype))
        if hit is not None:
            return hit
        flops = 4.0 * b * heads * sq * skv * d * (0.5 if causal and sq == skv else 1.0)
        per_head = 2.0 * sq * skv * d
        rate = self.gemm_rate(per_head * b * heads, dtype) if self._rates else \
            self.peak_flops(dtype)
        fwd = self.op_overhead_s + flops / rate
        bwd = self.bwd_op_overhead_s + self.op_overhead_s + 2.5 * flops / rate
        return fwd, bwd

    @staticmethod
    def _part_key(kind: str, d: dict) -> tuple:
        if kind == "layer":
            return (kind, d["b"], d["s"], d["h"], d["heads"], d["f"], d["kv"], d["dtype"],
                    bool(d.get("gated", False)))
        return (kind, d["b"], d["s"], d["h"], d["heads"], d["f"], d["kv"], d["vocab"],
                d["dtype"], bool(d.get("gated", False)))

    def part_time(self, kind: str, **dims) -> tuple[float, float] | None:
        """(forward, backward) seconds of the reference model's ``layer`` or its ``ends``
        (embedding, head, loss and the ``backward()`` call together) at a rank's local shape,
        when ``calibrate`` timed exactly that shape."""
        return self._parts.get(self._part_key(kind, dims))

    def mem_time(self, nbytes: float, ops: int = 1) -> float:
        """``ops`` memory-bound operators moving ``nbytes`` in all."""
        bw = self.mem_bandwidth or 1e11
        return ops * self.op_overhead_s + nbytes / bw

    # ---- communication ------------------------------------------------------------------
    def link_of(self, stride: int, size: int) -> str:
        """The link a group of ``size`` ranks spaced ``stride`` apart uses: ``intra`` when
        the whole group lies inside one node of ``ranks_per_node`` ranks."""
        if "inter" not in self.links and "inter" not in self.collectives:
            return "intra"
        return "intra" if stride * size <= self.ranks_per_node else "inter"

    def collective_time(self, op: str, n: int, message_bytes: float, link: str = "intra"
                        ) -> float:
        """Seconds of one ``op`` on ``n`` ranks with an S-byte message: the measured α-β fit
        for (link, op, n) when there is one; else the nearest measured group size scaled by
        the ring model; else the link's ring model."""
        if n <= 1 and op != "send":
            return 0.0
        ops = self.collectives.get(link) or self.collectives.get("intra") or {}
        fits = ops.get(op)
        if fits:
            f = fits.get(n)
            if f is not None:
                return f.time(message_bytes)
            # nearest measured size, scaled: latency by ring steps, bytes by wire factor
            near = min(fits, key=lambda g: abs(g - n))
            f = fits[near]
            steps0, steps1 = max(ring_steps(op, near), 1), max(ring_steps(op, n), 1)
            w0, w1 = wire_factor(op, near) or 1.0, wire_factor(op, n)
            return f.alpha_s * steps1 / steps0 + f.beta_s_per_byte * message_bytes * w1 / w0
        lk = self.links.get(link) or self.links.get("intra")
        if lk is None:
            return 0.0
        return ring_steps(op, n) * lk.latency_s + wire_factor(op, n) * message_bytes / \
            lk.bandwidth

    # ---- JSON ---------------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if not k.startswith("_")}
        d["collectives"] = {lk: {op: {str(n): asdict(f) for n, f in fits.items()}
                                 for op, fits in ops.items()}
                            for lk, ops in self.collectives.items()}
        d["links"] = {k: asdict(v) for k, v in self.links.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Profile":
        d = dict(d)
        known = set(cls.__dataclass_fields__)
        unknown = [k for k in d if k not in known]
        for k in unknown:
            d.pop(k)
        d["links"] = {k: Link(**v) for k, v in (d.get("links") or {}).items()}
        d["collectives"] = {lk: {op: {int(n): Fit(**f) for n, f in fits.items()}
                                 for op, fits in ops.items()}
                            for lk, ops in (d.get("collectives") or {}).items()}
        return cls(**d)

    def save(self, path: str | os.PathLike) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")
        return p

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Profile":
        return cls.from_dict(json.loads(Path(path).read_text()))

    def summary(self) -> dict:
        """The headline figures, for tables."""
        out = {"name": self.name, "device": self.device, "calibrated": self.calibrated,
               "memory_GB": self.memory_bytes / 1e9,
               "matmul_TFLOPs": {k: v / 1e12 for k, v in self.matmul_flops.items()},
               "mem_bandwidth_GBs": self.mem_bandwidth / 1e9,
               "op_overhead_us": self.op_overhead_s * 1e6, "overlap": self.overlap,
               "source": self.source}
        for lk, ops in self.collectives.items():
            for op, fits in ops.items():
                for n, f in sorted(fits.items()):
                    out.setdefault("collectives", {})[f"{lk}.{op}.n{n}"] = {
                        "alpha_us": f.alpha_s * 1e6, "GB_per_s": f.bandwidth / 1e9}
        for lk, v in self.links.items():
            out.setdefault("links", {})[lk] = {"GB_per_s": v.bandwidth / 1e9,
                                               "latency_us": v.latency_s * 1e6}
        return out


# ---------------------------------------------------------------------------------------
# presets from published specifications (uncalibrated)
# ---------------------------------------------------------------------------------------

_A100_SRC = ("NVIDIA A100 Tensor Core GPU datasheet (2021), SXM4 80GB: BF16 Tensor Core "
             "312 TFLOPS dense (624 with sparsity), FP32 19.5 TFLOPS, TF32 156 TFLOPS, HBM2e "
             "2,039 GB/s, 80GB, NVLink 600 GB/s (both directions: 300 GB/s each way); "
             "inter-node: DGX A100, 8 x 200 Gb/s HDR InfiniBand (25 GB/s per GPU each way)")
_H100_SRC = ("NVIDIA H100 Tensor Core GPU datasheet (2023), H100 SXM 80GB: BF16 Tensor Core "
             "989 TFLOPS dense (1,979 with sparsity), FP32 67 TFLOPS, TF32 494.5 TFLOPS "
             "dense, HBM3 3.35 TB/s, 80GB, NVLink 900 GB/s (450 GB/s each way); inter-node: "
             "DGX H100, 8 x 400 Gb/s NDR InfiniBand (50 GB/s per GPU each way)")
_H200_SRC = ("NVIDIA H200 Tensor Core GPU datasheet (2024), H200 SXM 141GB: BF16 Tensor Core "
             "989 TFLOPS dense (1,979 with sparsity), FP32 67 TFLOPS, HBM3e 4.8 TB/s, 141GB, "
             "NVLink 900 GB/s (450 GB/s each way); inter-node as DGX H100 (8 x 400 Gb/s NDR, "
             "50 GB/s per GPU each way)")
#: not in any datasheet: stated assumptions for the latency terms of the presets
_LATENCY_NOTE = ("latencies are assumptions, not datasheet figures: 10 us per ring step "
                 "inside a node (NVLink), 20 us between nodes (InfiniBand), 1 us kernel "
                 "launch hidden behind the queue (op overhead 0)")


def _gpu(name: str, desc: str, src: str, bf16: float, fp32: float, hbm: float, mem: float,
         nvlink_each_way: float, ib_each_way: float) -> Profile:
    return Profile(
        name=name, device="cuda", description=desc, calibrated=False,
        source=src + "; " + _LATENCY_NOTE, memory_bytes=mem,
        matmul_flops={"bf16": bf16, "fp16": bf16, "fp32": fp32},
        mem_bandwidth=hbm, op_overhead_s=0.0, bwd_op_overhead_s=0.0, backward_call_s=0.0,
        optimizer={"per_tensor_s": 0.0, "bytes_per_element": 32.0},
        ranks_per_node=8,
        links={"intra": Link(nvlink_each_way, 10e-6, "NVLink, per GPU each way"),
               "inter": Link(ib_each_way, 20e-6, "InfiniBand, per GPU each way")},
        overlap=1.0)


PRESETS: dict[str, Profile] = {
    "a100-80gb": _gpu("a100-80gb", "NVIDIA A100 SXM4 80GB, DGX A100 node (8 GPUs)",
                      _A100_SRC, 312e12, 19.5e12, 2.039e12, 80e9, 300e9, 25e9),
    "h100-80gb": _gpu("h100-80gb", "NVIDIA H100 SXM5 80GB, DGX H100 node (8 GPUs)",
                      _H100_SRC, 989e12, 67e12, 3.35e12, 80e9, 450e9, 50e9),
    "h200-141gb": _gpu("h200-141gb", "NVIDIA H200 SXM 141GB, HGX H200 node (8 GPUs)",
                       _H200_SRC, 989e12, 67e12, 4.8e12, 141e9, 450e9, 50e9),
}
ALIASES = {"a100": "a100-80gb", "h100": "h100-80gb", "h200": "h200-141gb",
           "a100-sxm": "a100-80gb", "h100-sxm": "h100-80gb", "h200-sxm": "h200-141gb",
           "cpu": "cpu-local"}


def preset_names() -> list[str]:
    return list(PRESETS)


def load_profile(name_or_path: str) -> Profile:
    """A profile by preset name (``a100-80gb``, ``h100-80gb``, ``h200-141gb``), by the name
    of a profile ``parbench calibrate`` saved (``cpu-local`` by default, in
    :func:`profile_dir`), or from a JSON path. Raises ``ConfigError`` naming what exists."""
    key = ALIASES.get(name_or_path.lower(), name_or_path.lower())
    if key in PRESETS:
        return Profile.from_dict(PRESETS[key].to_dict())
    path = Path(name_or_path)
    if path.suffix == ".json" or path.exists():
        if not path.exists():
            raise ConfigError(f"device={name_or_path!r}: no such profile file")
        try:
            return Profile.load(path)
        except (ValueError, TypeError, KeyError) as e:
            raise ConfigError(f"device={name_or_path!r} is not a profile: {e}") from None
    saved = profile_dir() / f"{key}.json"
    if saved.exists():
        return Profile.load(saved)
    have = sorted(p.stem for p in profile_dir().glob("*.json")) if profile_dir().exists() \
        else []
    hint = " (run `parbench calibrate` to write cpu-local)" if key == "cpu-local" else ""
    raise ConfigError(f"device={name_or_path!r} is not a preset ({', '.join(PRESETS)}), a "
                      f"calibrated profile ({', '.join(have) or 'none saved in ' + str(profile_dir())}) "
                      f"or a JSON file{hint}")
