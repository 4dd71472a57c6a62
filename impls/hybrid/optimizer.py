"""The hybrid's gradient synchronisation and optimizer step over a gradient group (the dense
parameters over ``dp_cp``, the experts over ``edp``), ZeRO stage 0-3, fp32 or bf16.

One :class:`GradientGroup` per group holds all of the rank's parameters of that group (every
stage it holds). ``n`` is the group's size, ``divisor`` what the summed gradient is divided
by (the dense group's size; dp x cp for the experts, see ``scheme``).

- **ZeRO-0**: the gradients are summed over the group with one all-reduce of their
  concatenation; AdamW steps the parameters (bf16: fp32 master copies, Micikevicius et al.
  2018, copied back into the bf16 parameters).
- **ZeRO-1**, Megatron's distributed optimizer (Rajbhandari et al. 2020 Sec. 5.1; Megatron-LM
  ``DistributedOptimizer``): parameters and gradients live in one flat buffer each, padded to
  a multiple of n, every ``p.data`` and ``p.grad`` a view into them; after the schedule the
  gradient buffer is reduce-scattered in place (the rank's slice gets its sum), AdamW steps
  the rank's fp32 shard, and the updated shards are all-gathered in place.
- **ZeRO-2** (Sec. 5.2): the same exchange, but the gradient buffer is released after the
  reduce-scatter; between steps the rank keeps its gradient shard only. Under a pipeline the
  full buffer must live through the step anyway (a stage's gradients accumulate over the
  micro-batches of the schedule -- the reason DeepSpeed refuses ZeRO-2 with its pipeline), so
  the saving is between steps.
- **ZeRO-3** (Sec. 5.3) as torchtitan composes FSDP2 with a pipeline
  (``reshard_after_forward=False``, gradient sync on the last backward only): between steps the
  rank keeps only its shards of parameters and gradients; a step starts with the all-gather
  of the parameters and ends with the reduce-scatter of the accumulated gradients, after which
  both full buffers are released. No re-gather in backward, so 2 Psi per step like ZeRO-1.

Every stage moves 2 x padded / n x (n - 1) bytes per step for ZeRO 1-3 (one reduce-scatter and
one all-gather of the padded buffer), the all-reduce's volume.

Clipping by global norm (``impls.hybrid.clip``) reads from a group the squares of the reduced
gradient elements the rank owns (``owned_sq``: every element with ZeRO-0, the rank's slice of
the flat buffer with ZeRO 1-3, padding excluded) and scales what the optimizer steps on and
what the verdict is shown (``scale_``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from parbench.model.training import grad_norm_sq, scale_grads_

from impls.tensor.collectives import all_reduce_flat


def _free(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(0)


def _restore(t: torch.Tensor) -> None:
    if t.untyped_storage().size() == 0:
        t.untyped_storage().resize_(t.numel() * t.element_size())


class GradientGroup:
    """The rank's parameters of one gradient group, their synchronisation and their masters."""

    def __init__(self, params: list[torch.Tensor], group, n: int, index: int,
                 divisor: int, zero_stage: int, dtype: torch.dtype):
        """``params``: fp32 (as built); they are moved to the compute ``dtype`` here, the
        fp32 values kept as the masters of a bf16 run."""
        self.params, self.group, self.n, self.divisor = params, group, n, divisor
        self.index = index
        self.zero, self.mixed = zero_stage, dtype != torch.float32
        if not params:
            self.masters = []
            return
        if zero_stage == 0:
            self.masters = [p.detach().clone() for p in params] if self.mixed else params
            for p in params:
                p.data = p.data.to(dtype)
            return
        numel = sum(p.numel() for p in params)
        self.shard = -(-numel // n)
        full32 = torch.zeros(self.shard * n, dtype=torch.float32, device=params[0].device)
        torch.cat([p.detach().reshape(-1) for p in params], out=full32[:numel])
        lo, hi = index * self.shard, (index + 1) * self.shard
        self.pbuf = full32.to(dtype) if self.mixed else full32
        self.gbuf = torch.zeros_like(self.pbuf)
        offset = 0
        for p in params:
            k = p.numel()
            p.data = self.pbuf[offset:offset + k].view_as(p)
            p.grad = self.gbuf[offset:offset + k].view_as(p)
            offset += k
        # ZeRO-1/2: the own slices are views (in-place collectives); ZeRO-3 keeps its
        # parameter shard apart from the buffer it frees
        self.own = self.pbuf[lo:hi] if zero_stage < 3 else \
            torch.nn.Parameter(self.pbuf[lo:hi].clone(), requires_grad=False)
        self.gown = self.gbuf[lo:hi] if zero_stage == 1 else torch.zeros_like(self.own)
        self.masters = [full32[lo:hi].clone() if self.mixed else self.own]
        del full32
        if zero_stage == 3:
            _free(self.pbuf)
        if zero_stage >= 2:
            _free(self.gbuf)
            self.own.grad = self.gown  # kept as the shard's gradient (the tracker's rule)

    # ---- the step ------------------------------------------------------------------------
    def begin(self) -> None:
        """Before the schedule: full buffers back; ZeRO-3 gathers its parameters."""
        if self.zero >= 2 and self.params:
            _restore(self.gbuf)
        if self.zero == 3 and self.params:
            _restore(self.pbuf)
            self._all_gather(self.own)

    def reduce(self) -> None:
        """Sum the gradients over the group (all-reduce, or reduce-scatter into the own
        shard) and divide; attach them to the masters."""
        if not self.params:
            return
        if self.zero == 0:
            grads = [p.grad for p in self.params]
            if self.n > 1:
                all_reduce_flat(grads, self.group)
            for g, master in zip(grads, self.masters):
                g.div_(self.divisor)
                if self.mixed:
                    master.grad = g.float()
            return
        if self.n > 1:
            dist.reduce_scatter_tensor(self.gown, self.gbuf, group=self.group)
        elif self.gown.data_ptr() != self.gbuf.data_ptr():
            self.gown.copy_(self.gbuf)
        self.gown.div_(self.divisor)
        self.masters[0].grad = self.gown.float() if self.mixed else self.gown
        if self.zero >= 2:
            _free(self.gbuf)

    def owned_sq(self, counted: set[int]) -> torch.Tensor:
        """After ``reduce``: the fp32 sum of squares of the reduced gradient elements this
        rank owns, of the parameters whose ids are in ``counted`` -- all of them with ZeRO-0,
        with ZeRO 1-3 the parts of them inside the rank's slice of the flat buffer (the
        padding belongs to no parameter)."""
        if not self.params:
            return grad_norm_sq([])
        if self.zero == 0:
            return grad_norm_sq([p.grad for p in self.params if id(p) in counted])
        lo, hi = self.index * self.shard, (self.index + 1) * self.shard
        parts, offset = [], 0
        for p in self.params:
            a, b = max(offset, lo), min(offset + p.numel(), hi)
            if a < b and id(p) in counted:
                parts.append(self.gown[a - lo:b - lo])
            offset += p.numel()
        return grad_norm_sq(parts)

    def scale_(self, coef: float) -> None:
        """After ``reduce``: multiply the reduced gradients (the ones ``full`` reports) and the
        masters' (the ones AdamW steps on; the same tensors in fp32) by ``coef``."""
        if not self.params:
            return
        reported = [p.grad for p in self.params] if self.zero == 0 else [self.gown]
        scale_grads_(reported, coef)
        if self.mixed:
            scale_grads_([m.grad for m in self.masters], coef)

    def finish(self) -> None:
        """After the optimizer step: masters into the compute-dtype parameters (all-gathered
        for ZeRO-1/2; ZeRO-3 releases its full parameters until the next step)."""
        if not self.params:
            return
        with torch.no_grad():
            if self.zero == 0:
                if self.mixed:
                    for p, master in zip(self.params, self.masters):
                        p.copy_(master)
                        master.grad = None
                return
            if self.mixed:
                self.own.copy_(self.masters[0])
                self.masters[0].grad = None
            elif self.zero >= 2:
                self.masters[0].grad = self.gown
            if self.zero == 3:
                _free(self.pbuf)
            else:
                self._all_gather(self.own)

    def _all_gather(self, own: torch.Tensor) -> None:
        if self.n > 1:
            dist.all_gather_into_tensor(self.pbuf, own, group=self.group)
        elif own.data_ptr() != self.pbuf.data_ptr():
            self.pbuf.copy_(own)

    # ---- the verdict's view (collective; outside the ledger) ------------------------------
    def materialize(self) -> None:
        """ZeRO-3 between steps: the full parameters again (until the step's own gather)."""
        if self.zero == 3 and self.params:
            _restore(self.pbuf)
            self._all_gather(self.own)

    def full(self, grads: bool) -> dict[int, torch.Tensor]:
        """id(param) -> its full (reduced) gradient or parameter, fp32 masters' values."""
        if not self.params:
            return {}
        if self.zero == 0:
            src = [p.grad for p in self.params] if grads else \
                (self.masters if self.mixed else self.params)
            return {id(p): t.detach().float() for p, t in zip(self.params, src)}
        shard = (self.gown if grads else self.masters[0]).detach().contiguous()
        flat = shard
        if self.n > 1:
            flat = torch.empty(self.shard * self.n, dtype=shard.dtype, device=shard.device)
            dist.all_gather_into_tensor(flat, shard, group=self.group)
        out, offset = {}, 0
        for p in self.params:
            out[id(p)] = flat[offset:offset + p.numel()].view_as(p).float()
            offset += p.numel()
        return out
