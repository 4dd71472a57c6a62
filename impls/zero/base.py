"""What the three ZeRO stages share: the unit layout over the dp group, the compute dtype and
fp32 master shards, the asynchronous reduce-scatters of gradient units, the optimizer step on
this rank's shards, and gathering shards back into full tensors for the comparison.

Mixed precision (``dtype=bf16``; Micikevicius et al. 2018): parameters and gradients are bf16,
the optimizer steps fp32 *master* shards (the paper's K = 12 counts them) and the updated
masters are copied into the bf16 shards.
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from parbench.config import CaseConfig
from parbench.model import (build_model, clip_coefficient, compute_dtype, make_optimizer,
                            scale_grads_)
from parbench.scheme import Prediction

from impls.common.clip import clip_grads_
from impls.data.base import DataParallelScheme

from .layout import build_layout, split_units, unit_views
from .prediction import zero_prediction

# torch 2.13 deprecates these names in favour of *_single; parbench's ledger wraps both.
warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*is deprecated")
warnings.filterwarnings("ignore", message=".*reduce_scatter_tensor.*is deprecated")


def all_gather_into(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool = False):
    return dist.all_gather_into_tensor(out, inp, group=group, async_op=async_op)


def reduce_scatter_into(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool = False):
    return dist.reduce_scatter_tensor(out, inp, group=group, async_op=async_op)


class ZeroScheme(DataParallelScheme):
    """Base of ZeRO stages 1-3. Subclasses set ``stage`` and fill, in ``__init__``:
    ``gshard`` (this rank's gradient shard per unit), ``masters`` (the fp32 shards the
    optimizer steps) and ``owned`` (the compute-dtype shards the masters are copied into), then
    call ``make_optimizer``."""

    stage: int = 1
    options = ("bucket_mb",)
    supports_clip_grad = True

    def __init__(self, ctx):
        super().__init__(ctx)
        self.dtype = compute_dtype(ctx.run)
        self.mixed = self.dtype != torch.float32
        self.model = build_model(ctx.model, ctx.run.seed).to(ctx.device)
        elem = torch.empty(0, dtype=self.dtype).element_size()
        self.layout = build_layout(self.model, self.dp_size, ctx.options.data.bucket_mb, elem)
        self.units = self.layout.units
        self.gbuf: torch.Tensor | None = None
        self.gshard: list[torch.Tensor] = []
        self.masters: list[torch.Tensor] = []
        self.owned: list[torch.Tensor] = []
        # (work, communication buffer kept alive, output, unit) per reduce-scatter in flight
        self._pending: list[tuple] = []
        self._mb = 0

    def module_probes(self):
        """The model's modules: ZeRO computes on whole (gathered) parameters."""
        return self.probes_of(self.model)

    def own_slice(self, flat: torch.Tensor, unit) -> torch.Tensor:
        """This rank's slice of a unit's padded flat buffer."""
        return flat[self.dp_rank * unit.shard:(self.dp_rank + 1) * unit.shard]

    def make_optimizer(self) -> None:
        """The run's optimizer over this rank's master shards (``self.opt``)."""
        self.opt = make_optimizer(self.masters, self.ctx.run)

    # ---- gradients ---------------------------------------------------------------------------
    def reduce_unit(self, i: int, flat: torch.Tensor, in_place: bool = False) -> None:
        """Reduce-scatter unit i's padded gradient buffer asynchronously into this rank's
        shard: in place (``flat`` holds the shard, ZeRO-1), or accumulated over the
        micro-batches after the first (ZeRO-2, -3)."""
        fresh = in_place or self._mb == 0
        out = self.gshard[i] if fresh else torch.empty_like(self.gshard[i])
        work = reduce_scatter_into(out, flat, self.group, True)
        self._pending.append((work, flat, out, i))

    def wait_reductions(self) -> None:
        for work, _flat, out, i in self._pending:
            work.wait()
            if out is not self.gshard[i]:
                self.gshard[i].add_(out)
        self._pending.clear()

    # ---- the optimizer step --------------------------------------------------------------------
    def step_masters(self) -> None:
        """Average the gradient shards, step this rank's fp32 masters (ZeRO Sec. 5.1), drop
        their gradients, and with mixed precision copy them into the compute-dtype shards."""
        for g in self.gshard:
            g.div_(self.dp_size)
        for master, g in zip(self.masters, self.gshard):
            master.grad = g if not self.mixed else g.float()
        self.clip()
        self.opt.step()
        for master in self.masters:
            master.grad = None
        if self.mixed:
            with torch.no_grad():
                for own, master in zip(self.owned, self.masters):
                    own.copy_(master)
        # the gradient shards stay attached to the shards they belong to (as ``.grad``,
        # torch's convention), which is how the memory tracker knows them as gradients
        for own, g in zip(self.owned, self.gshard):
            own.grad = g

    def clip(self) -> None:
        """Clip by global norm (``clip_grad``): the fp32 shards' squares summed over dp (the
        padding is zero), as Megatron-LM's distributed optimizer does; the compute-dtype
        shards, reported as the gradients, scaled by the same factor."""
        clip = self.ctx.run.clip_grad
        norm = clip_grads_([m.grad for m in self.masters], clip, groups=[self.group])
        if norm is not None and self.mixed:
            scale_grads_(self.gshard, clip_coefficient(norm, clip))

    # ---- comparison and accounting ------------------------------------------------------------
    def gather(self, shards: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Unsharded fp32 tensors by name from per-unit shards (collective; the harness calls
        it outside the ledger)."""
        out = {}
        for u, s in zip(self.units, shards):
            full = torch.empty(u.padded, dtype=s.dtype, device=s.device)
            all_gather_into(full, s.detach().contiguous(), self.group)
            out.update(zip(u.names, unit_views(full.float(), u)))
        return out

    def full_grads(self):
        return self.gather(self.gshard)

    @classmethod
    def predict(cls, case: CaseConfig) -> Prediction:
        return zero_prediction(case, cls.stage)


__all__ = ["ZeroScheme", "all_gather_into", "reduce_scatter_into", "split_units",
           "unit_views"]
