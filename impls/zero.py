"""Native ZeRO-1 (P_os) and ZeRO-2 (P_os+g) (Rajbhandari et al. 2020, Sec. 5.1-5.2, 7.2.1).

Every rank keeps the full compute-dtype parameters in one flat buffer of padded units
(``impls/zero_common``; each ``p.data`` is a view into it) and AdamW's states for its own
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
(ZeRO-2), per-rank wire bytes (d-1)/d of that. With ``dtype=bf16`` the parameters and
gradients are bf16 and the optimizer holds fp32 master shards (mixed precision, Micikevicius
et al. 2018; the paper's K = 12).
"""
from __future__ import annotations

import torch

from parbench.config import CaseConfig
from parbench.model import build_model, compute_dtype, make_optimizer
from parbench.scheme import register

from .common import DataParallelScheme, optimizer_tensors
from .zero_common import (all_gather_into, build_layout, reduce_scatter_into, split_units,
                          step_masters, unit_views, zero_prediction)


class _ZeroReplicated(DataParallelScheme):
    """ZeRO stages 1 and 2: replicated parameters, partitioned optimizer (and gradients)."""

    family = "data"
    uses = ("dp",)
    stage = 1

    def __init__(self, ctx):
        super().__init__(ctx)
        dev = ctx.device
        self.dtype = compute_dtype(ctx.run)
        self.mixed = self.dtype != torch.float32
        self.model = build_model(ctx.model, ctx.run.seed).to(dev)
        e = torch.empty(0, dtype=self.dtype).element_size()
        self.layout = build_layout(self.model, self.d, ctx.parallel.bucket_mb, e)
        units = self.layout.units
        named = dict(self.model.named_parameters(remove_duplicate=False))
        self.unit_params = [[named[n] for n in u.names] for u in units]
        # parameters: one flat buffer of padded units, fp32 first to seed the master shards
        full32 = torch.zeros(self.layout.padded_total, dtype=torch.float32, device=dev)
        self.ubuf32 = split_units(full32, [u.padded for u in units])
        for u, ps, buf in zip(units, self.unit_params, self.ubuf32):
            for p, v in zip(ps, unit_views(buf, u)):
                v.copy_(p.detach())
        self.pbuf = full32 if not self.mixed else full32.to(self.dtype)
        self.ubuf = split_units(self.pbuf, [u.padded for u in units])
        for u, ps, buf in zip(units, self.unit_params, self.ubuf):
            for p, v in zip(ps, unit_views(buf, u)):
                p.data = v
        self.own = [b[self.r * u.shard:(self.r + 1) * u.shard] for u, b in zip(units, self.ubuf)]
        if self.mixed:
            self.masters = [b[self.r * u.shard:(self.r + 1) * u.shard].clone()
                            for u, b in zip(units, self.ubuf32)]
        else:
            self.masters = self.own  # fp32: the own slice of the parameters is the master
        del full32, self.ubuf32
        # gradients
        if self.stage == 1:
            self.gbuf = torch.zeros(self.layout.padded_total, dtype=self.dtype, device=dev)
            self.ugrad = split_units(self.gbuf, [u.padded for u in units])
            for u, ps, buf in zip(units, self.unit_params, self.ugrad):
                for p, v in zip(ps, unit_views(buf, u)):
                    p.grad = v
            self.gshard = [b[self.r * u.shard:(self.r + 1) * u.shard]
                           for u, b in zip(units, self.ugrad)]
        else:
            self.gbuf = torch.zeros(self.layout.shard_total, dtype=self.dtype, device=dev)
            self.gshard = split_units(self.gbuf, [u.shard for u in units])
            self._tmp: list = [None] * len(units)
        self._unit_of = {}
        for i, ps in enumerate(self.unit_params):
            for p in ps:
                self._unit_of[p] = i
                if self.stage == 2:
                    p.register_hook(self._make_alloc(p))
                p.register_post_accumulate_grad_hook(self._on_grad)
        self.opt = make_optimizer(self.masters, ctx.run)
        self._ready = [0] * len(units)
        self._pending: list = []
        self._sync = False
        self._mb = 0

    # ---- gradient hooks -----------------------------------------------------------------
    def _make_alloc(self, p):
        def alloc(grad):
            i = self._unit_of[p]
            if self._tmp[i] is None:  # first gradient of this unit in this backward
                u = self.layout.units[i]
                buf = torch.zeros(u.padded, dtype=self.dtype, device=self.ctx.device)
                for q, v in zip(self.unit_params[i], unit_views(buf, u)):
                    q.grad = v
                self._tmp[i] = buf
            return None
        return alloc

    def _on_grad(self, p) -> None:
        if not self._sync:
            return
        i = self._unit_of[p]
        self._ready[i] += 1
        if self._ready[i] < len(self.unit_params[i]):
            return
        if self.stage == 1:  # in place: the own slice receives the reduced gradient
            work = reduce_scatter_into(self.gshard[i], self.ugrad[i], self.group, True)
            self._pending.append((work, None, None, None))
        else:
            buf, self._tmp[i] = self._tmp[i], None
            for q in self.unit_params[i]:
                q.grad = None
            out = self.gshard[i] if self._mb == 0 else torch.empty_like(self.gshard[i])
            work = reduce_scatter_into(out, buf, self.group, True)
            self._pending.append((work, buf, out, i))

    def _wait_reductions(self) -> None:
        for work, _buf, out, i in self._pending:
            work.wait()
            if out is not None and out is not self.gshard[i]:
                self.gshard[i].add_(out)
        self._pending.clear()

    # ---- the step -------------------------------------------------------------------------
    def train_step(self, inputs, targets, step):
        m = self.ctx.parallel.num_microbatches
        mbs = self.local_microbatches(inputs, targets)
        self.gbuf.zero_()
        tl = self.ctx.timeline
        total = 0.0
        for i, (xm, ym) in enumerate(mbs):
            self._mb = i
            self._sync = self.stage == 2 or i == m - 1
            self._ready = [0] * len(self._ready)
            with tl.span("F", mb=i):
                loss = self.model(xm, ym) / m
            with tl.span("B", mb=i):
                loss.backward()
            total += float(loss.detach())
            if self.stage == 2:
                with tl.span("wait", mb=i):
                    self._wait_reductions()
        with tl.span("wait"):
            self._wait_reductions()
        with tl.span("optim"):
            for g in self.gshard:
                g.div_(self.d)
            step_masters(self.opt, self.masters, self.gshard, self.mixed, self.own)
        works = [all_gather_into(buf, own, self.group, True)
                 for buf, own in zip(self.ubuf, self.own)]
        with tl.span("wait"):
            for w in works:
                w.wait()
        return self.reduce_loss(total / self.d, self.group)

    # ---- comparison and accounting ---------------------------------------------------------
    def _gather(self, shards: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Unsharded fp32 tensors by name from per-unit shards (collective; outside the
        ledger when the harness calls it)."""
        out = {}
        for u, s in zip(self.layout.units, shards):
            full = torch.empty(u.padded, dtype=s.dtype, device=s.device)
            all_gather_into(full, s.contiguous(), self.group)
            for n, v in zip(u.names, unit_views(full.float(), u)):
                out[n] = v
        return out

    def full_params(self):
        if not self.mixed:
            out = {}
            for u, buf in zip(self.layout.units, self.ubuf):
                out.update(zip(u.names, unit_views(buf, u)))
            return out
        return self._gather(self.masters)

    def full_grads(self):
        return self._gather(self.gshard)

    def state_tensors(self):
        opt = optimizer_tensors(self.opt) + (list(self.masters) if self.mixed else [])
        return {"params": [self.pbuf], "grads": [self.gbuf], "optimizer": opt}

    @classmethod
    def predict(cls, case: CaseConfig) -> dict:
        return zero_prediction(case, cls.stage)


@register
class Zero1(_ZeroReplicated):
    name = "zero.1"
    stage = 1
    description = "ZeRO-1: optimizer states partitioned (reduce-scatter + all-gather)"


@register
class Zero2(_ZeroReplicated):
    name = "zero.2"
    stage = 2
    description = "ZeRO-2: optimizer states and gradients partitioned"
