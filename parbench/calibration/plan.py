"""What a calibration measures (``Plan``: the model's shapes, group sizes, message sizes,
repeats) and the shape facts it needs."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class Plan:
    """What ``calibrate`` measures. ``shape``: a model :class:`~parbench.analytic.shape.Shape`
    (None: generic sizes only); ``micro_batch_sizes``, ``tp_splits`` and ``cp_splits``: the
    local shapes its GEMMs and attention are timed at."""

    device: str = "cpu"
    dtypes: tuple[str, ...] = ("fp32",)
    shape: Any = None
    micro_batch_sizes: tuple[int, ...] = (1, 2, 4)
    tp_splits: tuple[int, ...] = (1, 2)
    cp_splits: tuple[int, ...] = (1, 2)
    group_sizes: tuple[int, ...] = ()
    message_bytes: tuple[int, ...] = (4, 256, 4096, 65536, 1 << 20, 4 << 20)
    square_sizes: tuple[int, ...] = (128, 256, 512, 1024)
    copy_bytes: int = 64 << 20
    min_time_s: float = 0.05
    repeats: int = 5
    instrumented: bool = False
    reference: bool = True  # time the reference model's single-rank step (a check)

    def gemm_shapes(self) -> list[tuple[int, int, int]]:
        out: set[tuple[int, int, int]] = set()
        sh = self.shape
        if sh is None:
            return []
        h, f, V, s = sh.h, sh.f, sh.V, sh.s
        kv = kv_width(sh)
        for tp in self.tp_splits:
            if sh.a % tp or f % tp:
                continue
            vl = -(-V // tp)
            linears = [((h + 2 * kv) // tp, h), (h, h // tp), (f // tp, h), (h, f // tp),
                       (vl, h)]
            if gated_mlp(sh):
                linears.append((f // tp, h))
            for cp in self.cp_splits:
                if s % cp:
                    continue
                for b in self.micro_batch_sizes:
                    T = b * s // cp  # noqa: N806  (SP gathers the sequence before a GEMM)
                    for n_out, k_in in linears:
                        out.add((T, n_out, k_in))       # forward
                        out.add((T, k_in, n_out))       # input gradient
                        out.add((n_out, k_in, T))       # weight gradient
        return sorted(out)

    def layer_shapes(self) -> list[tuple[int, int, int]]:
        """(b, s_local, tp) of every local layer to time."""
        sh = self.shape
        if sh is None:
            return []
        return sorted({(b, sh.s // cp, tp) for tp in self.tp_splits for cp in self.cp_splits
                       for b in self.micro_batch_sizes
                       if not (sh.a % tp or sh.f % tp or sh.s % cp)})

    def attention_shapes(self) -> list[tuple[int, int, int, int, int]]:
        sh = self.shape
        if sh is None:
            return []
        out = set()
        d = sh.h // sh.a
        for tp in self.tp_splits:
            if sh.a % tp:
                continue
            for cp in self.cp_splits:
                if sh.s % cp:
                    continue
                for b in self.micro_batch_sizes:
                    out.add((b, sh.a // tp, sh.s // cp, sh.s // cp, d))
                    if cp > 1:  # all-gather / Ulysses-like: local queries, every key
                        out.add((b, sh.a // tp, sh.s // cp, sh.s, d))
        return sorted(out)


def kv_width(shape) -> int:
    """K (and V) width h_kv: h for multi-head attention, kv_heads x head dim with grouped-query
    attention (``Shape.kv_hidden`` where the shape has it)."""
    kv = getattr(shape, "kv_hidden", None)
    if kv:
        return int(kv)
    g = getattr(shape, "num_kv_heads", None)
    return int(g) * (shape.h // shape.a) if g else shape.h


def gated_mlp(shape) -> bool:
    """A gated MLP (SwiGLU: three h x f matrices) when the shape says so."""
    if getattr(shape, "gated", False):
        return True
    act = getattr(shape, "mlp", None)
    return isinstance(act, str) and act.lower() in ("swiglu", "geglu")


def model_config(name: str):
    """A model preset by name, or a JSON file of ``ModelConfig`` fields (``model=FILE.json``:
    a model no preset holds, such as the device check's ~1B-parameter step)."""
    from ..config import ConfigError, ModelConfig, model_preset
    if not name.endswith(".json"):
        return model_preset(name)
    try:
        fields = json.loads(Path(name).read_text())
        return ModelConfig(**{"name": Path(name).stem, **fields})
    except (OSError, ValueError, TypeError) as e:
        raise ConfigError(f"model={name!r}: {e}") from None
