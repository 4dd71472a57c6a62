"""Flat, padded, sharded parameter *units* shared by ZeRO-1, -2 and -3, and their prediction.

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

import warnings
from dataclasses import dataclass
from fractions import Fraction

import torch
import torch.distributed as dist

from parbench.analytic.comm import Transfer, summarize, zero_traffic
from parbench.analytic.memory import (FP32_ADAMW, MIXED_ADAM, MIXED_ADAM_FP32_GRAD,
                                      shard_numel, zero_model_states)
from parbench.config import CaseConfig
from parbench.model import build_model, compute_dtype

from .data import bucket_assignment

# torch 2.13 deprecates these names in favour of *_single; parbench's ledger wraps these.
warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*is deprecated")
warnings.filterwarnings("ignore", message=".*reduce_scatter_tensor.*is deprecated")


def all_gather_into(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool = False):
    return dist.all_gather_into_tensor(out, inp, group=group, async_op=async_op)


def reduce_scatter_into(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool = False):
    return dist.reduce_scatter_tensor(out, inp, group=group, async_op=async_op)


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
    return build_layout(model, case.parallel.dp, case.parallel.bucket_mb, e)


def unit_views(flat: torch.Tensor, unit: Unit) -> list[torch.Tensor]:
    """Views of a unit's flat buffer shaped like its parameters."""
    return [flat[o:o + n].view(s) for o, n, s in zip(unit.offsets, unit.sizes(), unit.shapes)]


def split_units(flat: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    out, o = [], 0
    for n in sizes:
        out.append(flat[o:o + n])
        o += n
    return out


# ---------------------------------------------------------------------------------------------
# prediction
# ---------------------------------------------------------------------------------------------


def zero_transfers(layout: Layout, stage: int, elem_bytes: int, m: int) -> list[Transfer]:
    """Every collective one rank makes in one step: one record per unit and kind."""
    d, out = layout.dp, []
    counts = {1: (1, 1, 0), 2: (m, 1, 0), 3: (m, 0, 2 * m)}[stage]  # rs, ag after step, ag fwd+bwd
    for u in layout.units:
        msg = u.padded * elem_bytes
        rs, ag_step, ag_use = counts
        out.append(Transfer("dp", "reduce_scatter", d, msg, rs, "gradients"))
        if ag_step:
            out.append(Transfer("dp", "all_gather", d, msg, ag_step, "updated parameters"))
        if ag_use:
            out.append(Transfer("dp", "all_gather", d, msg, ag_use,
                                "parameters before use (forward and backward)"))
    return out


def zero_state_bytes(layout: Layout, stage: int, elem_bytes: int, optimizer: str,
                     mixed: bool) -> dict[str, int]:
    """Exact bytes per rank of what a native ZeRO scheme holds at the end of a step.

    params: the compute-dtype flat buffer (stages 1, 2: all of Psi'; stage 3: the shard);
    grads: stage 1 the full compute-dtype buffer, stages 2, 3 the shard; optimizer: AdamW's
    exp_avg and exp_avg_sq in fp32 over the shard, one 4-byte ``step`` per unit, and -- with
    mixed precision -- the fp32 master shard (the paper's K = 12 includes it)."""
    full, shard = layout.padded_total, layout.shard_total
    params = (shard if stage == 3 else full) * elem_bytes
    grads = (full if stage == 1 else shard) * elem_bytes
    opt = 0
    if optimizer == "adamw":
        opt += 8 * shard + 4 * len(layout.units)
    if mixed:
        opt += 4 * shard
    return {"params": params, "grads": grads, "optimizer": opt}


def paper_figures(psi: int, dp: int, stage: int, elem_bytes: int, mixed: bool) -> dict:
    """The ZeRO paper's accounting beside ours (Rajbhandari et al. 2020, Sec. 5.1, Fig. 1;
    Sec. 7.2.1-7.2.2): model states per rank in (2 + 2 + K) Psi with K = 12, in the
    20-bytes-per-parameter accounting (K = 16, an fp32 gradient copy), and in the dtype this run
    uses (unpadded, AdamW ``step`` scalars not counted); traffic per step of the unpadded Psi in
    fp16 (2 bytes) and in the run's dtype, one micro-batch."""
    actual = MIXED_ADAM if mixed else FP32_ADAMW
    return {
        "psi": psi,
        "accountings": {"2+2+K, K=12 (fp16, mixed Adam)": "mixed_adam",
                        "20 bytes/param (fp32 grad copy, K=16)": "mixed_adam_fp32_grad",
                        "actual dtype": actual.name},
        "model_state_bytes": {
            "mixed_adam": zero_model_states(psi, dp, stage, MIXED_ADAM).as_dict(),
            "mixed_adam_fp32_grad": zero_model_states(psi, dp, stage,
                                                      MIXED_ADAM_FP32_GRAD).as_dict(),
            "actual_dtype": zero_model_states(psi, dp, stage, actual).as_dict(),
        },
        "wire_bytes": {
            "fp16": summarize(zero_traffic(psi, dp, stage, 2, pad=False)).get("dp", {}),
            "actual_dtype": summarize(zero_traffic(psi, dp, stage, elem_bytes,
                                                   pad=False)).get("dp", {}),
        },
    }


def zero_prediction(case: CaseConfig, stage: int) -> dict:
    """``predict()`` of the native ZeRO schemes: exact ledger and model-state bytes."""
    layout = case_layout(case)
    e = torch.empty(0, dtype=compute_dtype(case.run)).element_size()
    mixed = case.run.dtype == "bf16"
    transfers = zero_transfers(layout, stage, e, case.parallel.num_microbatches)
    wire = summarize(transfers).get("dp", {"wire_bytes": 0, "message_bytes": 0, "count": 0})
    return {
        "wire_bytes": {"dp": float(wire["wire_bytes"])},
        "message_bytes": {"dp": wire["message_bytes"]},
        "collectives": {"dp": wire["count"]},
        "transfers": [t.as_dict() for t in transfers],
        "model_state_bytes": zero_state_bytes(layout, stage, e, case.run.optimizer, mixed),
        "params": layout.psi,
        "padded_params": layout.padded_total,
        "shard_params": layout.shard_total,
        "units": len(layout.units),
        "paper": paper_figures(layout.psi, layout.dp, stage, e, mixed),
    }


def paper_prediction(case: CaseConfig, stage: int) -> dict:
    """``predict()`` of a baseline: the paper's accounting in the run's dtype (unpadded Psi,
    no AdamW step scalars), traffic repeated per micro-batch as the native scheme does it."""
    model = build_model(case.model, case.run.seed)
    psi = sum(p.numel() for p in model.parameters())
    e = torch.empty(0, dtype=compute_dtype(case.run)).element_size()
    mixed = case.run.dtype == "bf16"
    d, m = case.parallel.dp, case.parallel.num_microbatches
    f = Fraction(d - 1, d)
    per = {1: 2, 2: m + 1, 3: 3 * m}[stage]
    ms = zero_model_states(psi, d, stage, MIXED_ADAM if mixed else FP32_ADAMW)
    return {
        "wire_bytes": {"dp": float(f * per * psi * e)},
        "model_state_bytes": {"params": ms.param, "grads": ms.grad, "optimizer": ms.optim},
        "params": psi,
        "paper": paper_figures(psi, d, stage, e, mixed),
    }


def step_masters(opt, masters: list[torch.Tensor], grad_shards: list[torch.Tensor],
                 mixed: bool, owned: list[torch.Tensor]) -> None:
    """The optimizer step on this rank's fp32 master shards (ZeRO Sec. 5.1): hand each master
    its (averaged) gradient shard, step, drop the gradients, and with mixed precision copy
    the updated masters into the low-precision shards the model computes with."""
    for master, g in zip(masters, grad_shards):
        master.grad = g if not mixed else g.float()
    opt.step()
    for master in masters:
        master.grad = None
    if mixed:
        with torch.no_grad():
            for own, master in zip(owned, masters):
                own.copy_(master)
