"""torch.nn.parallel.DistributedDataParallel on the same case, with torch's stock hook.

DDP's C++ reducer all-reduces its buckets by calling the process group directly, past the
Python functions parbench's ledger wraps. The baseline registers the stock all-reduce
communication hook (``default_hooks.allreduce_hook``: the reducer's own all-reduce with the
same pre-division by the group size, issued through ``torch.distributed.all_reduce``), so
the ledger sees every bucket -- in every step, the timed ones included: their ledgers are
verified like the checked steps' (issue 20), so the figures timed are those of the
computation checked. The reducer, its buckets and their overlap with backward stay torch's;
the hook adds one Python call per bucket. With ``clip_grad`` the step calls
``torch.nn.utils.clip_grad_norm_`` on the replicated gradients, as a DDP training loop does.
"""
from __future__ import annotations

import contextlib
import gc

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from parbench.model import build_model, make_optimizer
from parbench.scheme import register

from impls.data.base import ReplicaScheme
from impls.data.ddp import ddp_prediction


@register
class TorchDDP(ReplicaScheme):
    name = "baseline.torch.ddp"
    family = "data"
    baseline_of = "data.ddp"
    description = "torch DistributedDataParallel (stock all-reduce hook, every step)"
    uses = ("dp",)
    options = ("bucket_mb",)
    supports_clip_grad = True

    def __init__(self, ctx):
        super().__init__(ctx)
        self.model = build_model(ctx.model, ctx.run.seed).to(ctx.device)
        self.ddp = None
        self._wrap(accounted=True)
        self.opt = make_optimizer(self.model.parameters(), ctx.run)

    def _wrap(self, accounted: bool) -> None:
        """Wrap the module in a new DDP: with the ledger-visible hook, or stock."""
        self.ddp = None
        gc.collect()  # the old reducer's hooks go with it
        self.ddp = DistributedDataParallel(self.model, process_group=self.group,
                                           bucket_cap_mb=self.ctx.options.data.bucket_mb)
        if accounted:
            self.ddp.register_comm_hook(self.group, default_hooks.allreduce_hook)
        self.accounted = accounted

    def train_step(self, inputs, targets, step):
        # every step, timed ones included, keeps the stock all-reduce hook: the timed steps'
        # ledgers are verified too (issue 20), and the C++ path would pass the ledger by
        m = self.ctx.layout.num_microbatches
        mbs = self.local_microbatches(inputs, targets)
        self.opt.zero_grad(set_to_none=False)
        tl = self.ctx.timeline
        total = 0.0
        for i, (xm, ym) in enumerate(mbs):
            last = i == m - 1
            with self.ddp.no_sync() if not last else contextlib.nullcontext():
                total += self.forward_backward(self.ddp, xm, ym, i)
        with tl.span("optim"):
            if self.ctx.run.clip_grad:  # torch's own clipping, as a DDP user calls it
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.ctx.run.clip_grad)
            self.opt.step()
        return self.reduce_loss(total / self.dp_size, self.group)

    @classmethod
    def predict(cls, case):
        return ddp_prediction(case)
