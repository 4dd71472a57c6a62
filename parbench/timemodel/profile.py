"""Device profiles: what one device computes and how fast its links move bytes.

A :class:`Profile` is what the time model (:mod:`.model`) reads. It comes either from
``parbench calibrate`` (measured on this machine or on a cluster node, ``calibrated=True``) or
from a preset written from a vendor's published specification (``calibrated=False``: peak
figures, never reached in practice, so predicted step times are lower bounds and MFU upper
bounds until the device is calibrated).

Fields (SI units: seconds, bytes, FLOP/s, bytes/s):

- ``matmul_flops``: dense matrix-multiply throughput per dtype (``fp32``, ``bf16``); measured:
  the best of the square GEMMs timed by ``calibrate``; preset: the datasheet's dense peak;
- ``matmul_achievable``: the best matmul throughput per dtype a published micro-benchmark
  reached on the device (presets; :mod:`.devices` names the source), and ``sm_count`` its
  streaming multiprocessors: an uncalibrated profile prices a GEMM by its shape from these
  (:meth:`Profile.gemm_time`);
- ``gemms``: measured GEMMs ``{"m", "n", "k", "dtype", "seconds"}`` (C[m,n] = A[m,k] B[k,n]),
  at the model's own shapes when ``calibrate`` was given a model; the model interpolates the
  achieved rate in log(FLOPs) between them (:meth:`Profile.gemm_time`);
- ``mem_bandwidth``: bytes/s of a large copy (read + write counted), ``op_overhead_s``: the
  fixed cost of one eager operator, ``bwd_op_overhead_s``: of one autograd node in backward,
  ``backward_call_s``: of one ``loss.backward()`` call; ``grad_reentry_s``: of one
  ``autograd.grad`` call re-entering a kept graph at a node, and ``graph_walk_s``: what each
  node below the entry adds to it (a split backward's W, ``split_backward_cost``);
- ``attention``: measured fused-attention kernels ``{"b", "heads", "sq", "skv", "d",
  "dtype", "fwd_s", "bwd_s"}``;
- ``parts``: the reference model's in-graph costs at each rank's local shape, ``kind``
  ``layer`` (one transformer layer) and ``ends`` (embedding, head, loss and the ``backward()``
  call), from timing the local model at two depths ``{"kind", "b", "s", "tp", "h", "heads",
  "f", "kv", "vocab", "dtype", "fwd_s", "bwd_s"}``, a layer also its autograd graph's
  ``graph_nodes`` and ``weight_nodes`` (``calibrate model=...``); the time model
  uses them where the shape matches and scales its operator count by their ratio elsewhere;
- ``optimizer``: AdamW's cost ``{"per_tensor_s", "per_element_s"}`` (single-tensor
  ``torch.optim.AdamW``, as parbench runs it, on CPU; a fused multi-tensor kernel on GPUs),
  or on a preset ``{"bytes_per_element", "mixed_bytes_<dtype>"}``: AdamW's bytes and a 16-bit
  run's extra mixed-precision passes, each element, over ``mem_bandwidth``;
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
    """A class of connection: per-rank bandwidth in one direction (bytes/s), the latency of
    one step of a ring or one point-to-point message (s), and a collective's fixed latency
    beside its steps (``base_latency_s``: NCCL's tuning model has one per algorithm and
    protocol; 0 where the step latency is all that was measured)."""

    bandwidth: float
    latency_s: float
    source: str = ""
    base_latency_s: float = 0.0


#: the output tiles (rows, columns) a GEMM library picks among on NVIDIA GPUs since Ampere
#: (the Matrix Multiplication Background guide's examples: 256x128, 128x256, 128x128)
GEMM_TILES = ((256, 128), (128, 256), (128, 128))


def wave_efficiency(m: int, n: int, sms: int) -> float:
    """The share of the streaming multiprocessors' tile slots an m x n output fills: tiles /
    (ceil(tiles / SMs) x SMs), the best over :data:`GEMM_TILES` (1 when ``sms`` is 0: no
    wave model). A tile only partly inside the output costs a whole one (tile
    quantization); an output narrower than a tile is cut into tiles of its own width,
    rounded up to the 16 of a tensor-core fragment (the library's skinny kernels)."""
    if sms <= 0:
        return 1.0
    best = 0.0
    for tm, tn in GEMM_TILES:
        tm, tn = min(tm, -(-m // 16) * 16), min(tn, -(-n // 16) * 16)
        tiles = -(-m // tm) * -(-n // tn)
        useful = (m * n) / (tm * tn)
        best = max(best, useful / (-(-tiles // sms) * sms))
    return best


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
    matmul_achievable: dict[str, float] = field(default_factory=dict)
    sm_count: int = 0
    mem_bandwidth: float = 0.0
    op_overhead_s: float = 0.0
    bwd_op_overhead_s: float = 0.0
    backward_call_s: float = 0.0
    grad_reentry_s: float = 0.0
    graph_walk_s: float = 0.0
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
        fixed cost), else the shape model of :meth:`shaped_gemm_time` plus one operator's
        overhead."""
        t = self._exact.get((m, n, k, dtype))
        if t is not None:
            return t
        flops = 2.0 * m * n * k
        if self._rates.get(dtype) or (self.calibrated and self._rates):
            return flops / self.gemm_rate(flops, dtype)
        return self.op_overhead_s + self.shaped_gemm_time(m, n, k, dtype)

    def shaped_gemm_time(self, m: int, n: int, k: int, dtype: str) -> float:
        """An uncalibrated device's GEMM priced by its shape (NVIDIA, "Matrix Multiplication
        Background User's Guide", sections on math- vs memory-bound GEMMs and on tile and
        wave quantization): the slower of

        - compute: 2mnk FLOPs at the achievable matmul rate (``matmul_achievable``, else the
          datasheet peak) times the wave efficiency -- the output is cut into tiles, one
          per streaming multiprocessor at a time, and the last wave runs partly empty:
          tiles / (waves x SMs), the best over the library's usual tiles
          (:data:`GEMM_TILES`);
        - memory: A, B read and C written once, e (m k + k n + m n) bytes over the memory
          bandwidth.
        """
        flops = 2.0 * m * n * k
        rate = self.matmul_achievable.get(dtype) or self.peak_flops(dtype)
        compute = flops / (rate * wave_efficiency(m, n, self.sm_count))
        nbytes = (4 if dtype == "fp32" else 2) * (m * k + k * n + m * n)
        return max(compute, nbytes / self.mem_bandwidth if self.mem_bandwidth else 0.0)

    def attention_time(self, b: int, heads: int, sq: int, skv: int, d: int, dtype: str,
                       causal: bool = True, fused: bool = True) -> tuple[float, float]:
        """(forward, backward) seconds of one attention core: measured when timed at this
        shape, else priced.

        ``fused`` (FlashAttention, Dao et al. 2022): 4 b heads sq skv d FLOPs forward (QK^T
        and AV) and 2.5x that backward (the scores recomputed), halved when causal (masked
        blocks are skipped), plus one operator's overhead each way. Unfused (Megatron's
        attention before flash, as Korthikanti et al. 2022 ran it): the two batched GEMMs
        over every score, masked or not, plus the scores' round trips through memory --
        forward the scores written, the fused scale-mask-softmax reading them and writing
        probabilities, dropout reading those and writing its output and a one-byte mask,
        the AV GEMM reading it (6 e + 1 bytes a score); backward the reverse, with the
        softmax output read again and the scores' gradient read by both of QK^T's backward
        GEMMs (dQ = dS K and dK = dS^T Q): 9 e + 1 -- the elements Korthikanti et al. Table 2
        count as 5as^2b bytes of activations."""
        hit = self._attn.get((b, heads, sq, skv, d, dtype))
        if hit is not None:
            return hit
        half = 0.5 if causal and sq == skv and fused else 1.0
        flops = 4.0 * b * heads * sq * skv * d * half
        per_head = 2.0 * sq * skv * d
        rate = self.gemm_rate(per_head * b * heads, dtype) if self._rates else \
            self.matmul_achievable.get(dtype) or self.peak_flops(dtype)
        fwd = self.op_overhead_s + flops / rate
        bwd = self.bwd_op_overhead_s + self.op_overhead_s + (2.5 if fused else 2.0) * \
            flops / rate
        if not fused:
            e = 4 if dtype == "fp32" else 2
            scores = float(b * heads * sq * skv)
            fwd += self.mem_time((6 * e + 1) * scores, 4)
            bwd += self.mem_time((9 * e + 1) * scores, 4)
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
        return lk.base_latency_s + ring_steps(op, n) * lk.latency_s + \
            wire_factor(op, n) * message_bytes / lk.bandwidth

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
