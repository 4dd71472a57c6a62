"""torch.nn.parallel.DistributedDataParallel on the same case.

DDP's C++ reducer all-reduces buckets itself; registering the stock all-reduce
communication hook (``default_hooks.allreduce_hook``, what DDP does by default, pre-dividing
by the group size) routes those calls through ``torch.distributed.all_reduce`` so they land
in parbench's ledger like ours.
"""
from __future__ import annotations

from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from parbench.model import build_model, make_optimizer
from parbench.scheme import register

from ..common import DataParallelScheme, ReplicaMixin, optimizer_tensors
from ..data import ddp_prediction


@register
class TorchDDP(ReplicaMixin, DataParallelScheme):
    name = "baseline.torch.ddp"
    family = "data"
    baseline_of = "data.ddp"
    description = "torch DistributedDataParallel (stock all-reduce hook)"
    uses = ("dp",)

    def __init__(self, ctx):
        super().__init__(ctx)
        self.model = build_model(ctx.model, ctx.run.seed).to(ctx.device)
        self.ddp = DistributedDataParallel(self.model, process_group=self.group,
                                           bucket_cap_mb=ctx.parallel.bucket_mb)
        self.ddp.register_comm_hook(self.group, default_hooks.allreduce_hook)
        self.opt = make_optimizer(self.model.parameters(), ctx.run)

    def train_step(self, inputs, targets, step):
        m = self.ctx.parallel.num_microbatches
        mbs = self.local_microbatches(inputs, targets)
        self.opt.zero_grad(set_to_none=False)
        tl = self.ctx.timeline
        total = 0.0
        for i, (xm, ym) in enumerate(mbs):
            last = i == m - 1
            ctx = self.ddp.no_sync() if not last else _null()
            with ctx:
                with tl.span("F", mb=i):
                    loss = self.ddp(xm, ym) / m
                with tl.span("B", mb=i):
                    loss.backward()
            total += float(loss.detach())
        with tl.span("optim"):
            self.opt.step()
        return self.reduce_loss(total / self.d, self.group)

    def state_tensors(self):
        return {"params": list(self.model.parameters()),
                "grads": [p.grad for p in self.model.parameters() if p.grad is not None],
                "optimizer": optimizer_tensors(self.opt)}

    @classmethod
    def predict(cls, case):
        return ddp_prediction(case)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
