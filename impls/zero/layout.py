"""Flat, padded, sharded parameter *units* shared by ZeRO-1, -2 and -3.

ZeRO-DP (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", Sec. 5 and 7) partitions optimizer states (stage 1), gradients (stage 2)
and parameters (stage 3) over the Nd data-parallel ranks. Here the model's layers
(``embed``, ``blocks.{i}``, ``head``) are grouped, in reverse order as gradients become ready,
into *units* of at least ``bucket_mb`` MiB (the same rule as DDP's gradient buckets, at layer
granularity). Each unit is one flat buffer of its parameters padded with zeros to a multiple of
d = Nd; rank r owns elements ``[r c_u, (r+1) c_u)`` of unit u, ``c_u = ceil(Psi_u / d)``. A unit
is what one collective moves: the reduce-scatter of its gradients, the all-gather of its
parameters -- and, in ZeRO-3, the granularity of gathering before use and freeing after use.
With a bucket larger than the model there is one unit: one buffer of ``d * ceil(Psi / d)``
elements, ``ceil(Psi / d)`` per rank.

Every message is a whole padded unit, so the traffic per step is exact in the padded size
Psi' = sum_u d c_u (Sec. 7.2: ZeRO-1/2 reduce-scatter + all-gather = 2 Psi', ZeRO-3 all-gather
forward + all-gather backward + reduce-scatter = 3 Psi'), each with the (d-1)/d ring factor.
With m micro-batches per step (gradient accumulation) ZeRO-1 keeps its full gradients and
reduces once; ZeRO-2 keeps only its gradient partition and so reduce-scatters every
micro-batch ((m + 1) Psi'); ZeRO-3 gathers and reduces for every micro-batch (3 m Psi').

The optimizer is ``parbench.model.make_optimizer`` (AdamW, ``foreach=False``: elementwise, so
updating a flat shard equals updating the full tensors) over one fp32 shard tensor per unit,
so AdamW keeps U float32 ``step`` scalars.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from parbench.analytic.memory import shard_numel
from parbench.config import CaseConfig
from parbench.model import build_model, compute_dtype

from impls.data.buckets import bucket_assignment


# ---------------------------------------------------------------------------------------------
# layout
# ---------------------------------------------------------------------------------------------


def model_layers(model) -> list[tuple[str, torch.nn.Module]]:
    """The reference model's layers in forward order: embed, blocks.0 .. blocks.L-1, head."""
    out = []
    if model.embed is not None:
        out.append(("embed", model.embed))
    out += [(f"blocks.{i}", blk) for i, blk in model.blocks.items()]
    if model.head is not None:
        out.append(("head", model.head))
    return out


@dataclass(frozen=True)
class Unit:
    """One flat buffer: the parameters of some consecutive layers, padded to d * shard."""

    layers: tuple[str, ...]
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]  # of each parameter inside the unit
    numel: int  # Psi_u
    shard: int  # c_u = ceil(Psi_u / d)
    dp: int

    @property
    def padded(self) -> int:
        return self.shard * self.dp

    def sizes(self) -> list[int]:
        return [int(torch.Size(s).numel()) for s in self.shapes]


@dataclass(frozen=True)
class Layout:
    units: tuple[Unit, ...]
    dp: int
    psi: int

    @property
    def padded_total(self) -> int:  # Psi'
        return sum(u.padded for u in self.units)

    @property
    def shard_total(self) -> int:  # per rank
        return sum(u.shard for u in self.units)

    def padded_offsets(self) -> list[int]:
        out, o = [], 0
        for u in self.units:
            out.append(o)
            o += u.padded
        return out

    def shard_offsets(self) -> list[int]:
        out, o = [], 0
        for u in self.units:
            out.append(o)
            o += u.shard
        return out


def build_layout(model, dp: int, bucket_mb: float, elem_bytes: int) -> Layout:
    """Group layers into units of at least ``bucket_mb`` MiB, in reverse order (the
    remainder is the first unit). A tied parameter belongs to the first layer that has it."""
    layers = model_layers(model)
    seen: set[int] = set()
    per_layer = []
    for lname, mod in layers:
        ps = []
        for n, p in mod.named_parameters(prefix=lname):
            if id(p) in seen:
                continue
            seen.add(id(p))
            ps.append((n, tuple(p.shape), p.numel()))
        per_layer.append(ps)
    cap = max(1, int(bucket_mb * 2**20 / elem_bytes))
    groups = bucket_assignment([sum(n for *_, n in ps) for ps in per_layer], cap)
    units = []
    for idx in reversed(groups):
        idx = sorted(idx)
        names, shapes, offsets, off = [], [], [], 0
        for i in idx:
            for n, shape, k in per_layer[i]:
                names.append(n)
                shapes.append(shape)
                offsets.append(off)
                off += k
        units.append(Unit(tuple(layers[i][0] for i in idx), tuple(names), tuple(shapes),
                          tuple(offsets), off, shard_numel(off, dp), dp))
    psi = sum(u.numel for u in units)
    return Layout(tuple(units), dp, psi)


def case_layout(case: CaseConfig) -> Layout:
    """The layout a case's ZeRO scheme uses (pure: builds the model on this process)."""
    model = build_model(case.model, case.run.seed)
    e = torch.empty(0, dtype=compute_dtype(case.run)).element_size()
    return build_layout(model, case.layout.dp, case.options.data.bucket_mb, e)


def unit_views(flat: torch.Tensor, unit: Unit) -> list[torch.Tensor]:
    """Views of a unit's flat buffer shaped like its parameters."""
    return [flat[o:o + n].view(s) for o, n, s in zip(unit.offsets, unit.sizes(), unit.shapes)]


def split_units(flat: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    out, o = [], 0
    for n in sizes:
        out.append(flat[o:o + n])
        o += n
    return out
