"""Native ZeRO-1 (P_os) and ZeRO-2 (P_os+g) (Rajbhandari et al. 2020, Sec. 5.1-5.2, 7.2.1).

Every rank keeps the full compute-dtype parameters in one flat buffer of padded units
(``impls/zero/layout``; each ``p.data`` is a view into it) and AdamW's states for its own
shard of every unit only.

- ZeRO-1: gradients accumulate in a full flat buffer (``p.grad`` are views) over the m
  micro-batches; during the last backward each unit is reduce-scattered as soon as its
  gradients are complete (asynchronously, overlapping the rest of backward), in place into the
  rank's own slice.
- ZeRO-2: no full gradient buffer is kept. A unit's buffer is allocated when its first gradient
  arrives, reduce-scattered as soon as it is complete -- in every micro-batch -- and released;
  the rank keeps only its gradient shard, accumulated over micro-batches.

Then AdamW steps the rank's fp32 shards and every unit's updated parameters are all-gathered
in place. Traffic per step: reduce-scatter + all-gather = 2 Psi' (ZeRO-1) or (m + 1) Psi'
(ZeRO-2), per-rank wire bytes (d-1)/d of that.
"""
from __future__ import annotations

import torch

from parbench.scheme import register

from .base import ZeroScheme, all_gather_into, split_units, unit_views


class ReplicatedParamsZero(ZeroScheme):
    """ZeRO stages 1 and 2: replicated parameters, partitioned optimizer (and gradients)."""

    def __init__(self, ctx):
        super().__init__(ctx)
        dev = ctx.device
        named = dict(self.model.named_parameters(remove_duplicate=False))
        self.unit_params = [[named[n] for n in u.names] for u in self.units]
        padded = [u.padded for u in self.units]
        # parameters: one flat buffer of padded units, fp32 first to seed the master shards
        full32 = torch.zeros(self.layout.padded_total, dtype=torch.float32, device=dev)
        units32 = split_units(full32, padded)
        for u, params, buf in zip(self.units, self.unit_params, units32):
            for p, view in zip(params, unit_views(buf, u)):
                view.copy_(p.detach())
        self.pbuf = full32 if not self.mixed else full32.to(self.dtype)
        self.ubuf = split_units(self.pbuf, padded)
        for u, params, buf in zip(self.units, self.unit_params, self.ubuf):
            for p, view in zip(params, unit_views(buf, u)):
                p.data = view
        self.owned = [self.own_slice(b, u) for u, b in zip(self.units, self.ubuf)]
        # fp32: the own slice of the parameters is the master
        self.masters = [self.own_slice(b, u).clone() for u, b in zip(self.units, units32)] \
            if self.mixed else self.owned
        del full32, units32
        if self.stage == 1:
            self.gbuf = torch.zeros(self.layout.padded_total, dtype=self.dtype, device=dev)
            self.ugrad = split_units(self.gbuf, padded)
            for u, params, buf in zip(self.units, self.unit_params, self.ugrad):
                for p, view in zip(params, unit_views(buf, u)):
                    p.grad = view
            self.gshard = [self.own_slice(b, u) for u, b in zip(self.units, self.ugrad)]
        else:
            self.gbuf = torch.zeros(self.layout.shard_total, dtype=self.dtype, device=dev)
            self.gshard = split_units(self.gbuf, [u.shard for u in self.units])
            self._unit_grad: list[torch.Tensor | None] = [None] * len(self.units)
        self._unit_of = {}
        for i, params in enumerate(self.unit_params):
            for p in params:
                self._unit_of[p] = i
                if self.stage == 2:
                    p.register_hook(self._allocate_on_first_grad(p))
                p.register_post_accumulate_grad_hook(self._on_grad)
        self.make_optimizer()
        self._ready = [0] * len(self.units)
        self._sync = False

    # ---- gradient hooks -----------------------------------------------------------------
    def _allocate_on_first_grad(self, p):
        def allocate(grad):
            i = self._unit_of[p]
            if self._unit_grad[i] is None:  # first gradient of this unit in this backward
                u = self.units[i]
                buf = torch.zeros(u.padded, dtype=self.dtype, device=self.ctx.device)
                for q, view in zip(self.unit_params[i], unit_views(buf, u)):
                    q.grad = view
                self._unit_grad[i] = buf
            return None
        return allocate

    def _on_grad(self, p) -> None:
        if not self._sync:
            return
        i = self._unit_of[p]
        self._ready[i] += 1
        if self._ready[i] < len(self.unit_params[i]):
            return
        if self.stage == 1:  # in place: the own slice receives the reduced gradient
            self.reduce_unit(i, self.ugrad[i], in_place=True)
        else:
            buf, self._unit_grad[i] = self._unit_grad[i], None
            for q in self.unit_params[i]:
                q.grad = None
            self.reduce_unit(i, buf)

    # ---- the step -------------------------------------------------------------------------
    def train_step(self, inputs, targets, step):
        m = self.ctx.layout.num_microbatches
        self.gbuf.zero_()
        tl = self.ctx.timeline
        total = 0.0
        for i, (xm, ym) in enumerate(self.local_microbatches(inputs, targets)):
            self._mb = i
            self._sync = self.stage == 2 or i == m - 1
            self._ready = [0] * len(self._ready)
            total += self.forward_backward(self.model, xm, ym, i)
            if self.stage == 2:
                with tl.span("wait", mb=i):
                    self.wait_reductions()
        with tl.span("wait"):
            self.wait_reductions()
        with tl.span("optim"):
            self.step_masters()
        works = [all_gather_into(buf, own, self.group, True)
                 for buf, own in zip(self.ubuf, self.owned)]
        with tl.span("wait"):
            for w in works:
                w.wait()
        return self.reduce_loss(total / self.dp_size, self.group)

    # ---- comparison and accounting ---------------------------------------------------------
    def full_params(self):
        if self.mixed:
            return self.gather(self.masters)
        out = {}
        for u, buf in zip(self.units, self.ubuf):
            out.update(zip(u.names, unit_views(buf, u)))
        return out


@register
class Zero1(ReplicatedParamsZero):
    name = "zero.1"
    stage = 1
    description = "ZeRO-1: optimizer states partitioned (reduce-scatter + all-gather)"


@register
class Zero2(ReplicatedParamsZero):
    name = "zero.2"
    stage = 2
    description = "ZeRO-2: optimizer states and gradients partitioned"
