"""Native DDP: gradient buckets in reverse parameter order, all-reduced as they fill.

Each replica holds the whole model. Gradients live in flat bucket buffers (``p.grad`` is a
view into its bucket, as in Megatron-Core's contiguous grad buffer); a hook after gradient
accumulation counts the parameters of a bucket that are ready and, on the last micro-batch,
launches an asynchronous all-reduce of the bucket as soon as it is full, so communication
overlaps the rest of backward (Li et al. 2020, "PyTorch Distributed", Sec. 3.2). Gradients
are pre-divided by the data-parallel size. Traffic per step: 2(d-1)/d * Psi * bytes per rank
(ring all-reduce of every gradient once).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from parbench.analytic import data_parallel, shape_from
from parbench.config import CaseConfig
from parbench.model import build_model, make_optimizer
from parbench.scheme import Prediction, register

from impls.common.clip import clip_grads_

from .base import ReplicaScheme
from .buckets import Bucket, bucket_assignment


@register
class NativeDDP(ReplicaScheme):
    name = "data.ddp"
    family = "data"
    description = "DDP: bucketed gradient all-reduce overlapping backward"
    uses = ("dp",)
    options = ("bucket_mb",)
    supports_clip_grad = True

    def __init__(self, ctx):
        super().__init__(ctx)
        self.model = build_model(ctx.model, ctx.run.seed).to(ctx.device)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        cap = max(1, int(ctx.options.data.bucket_mb * 2**20 / self.params[0].element_size()))
        self.buckets = [Bucket([self.params[i] for i in idx], self.params[0].dtype, ctx.device)
                        for idx in bucket_assignment([p.numel() for p in self.params], cap)]
        self._bucket_of = {}
        for b in self.buckets:
            for p in b.params:
                self._bucket_of[p] = b
                p.register_post_accumulate_grad_hook(self._on_grad)
        self.opt = self.make_optimizer(self.params)
        self._sync = False

    def make_optimizer(self, params):
        return make_optimizer(params, self.ctx.run)

    def clip(self) -> None:
        """Clip by global norm (``clip_grad``): after the all-reduce every replica holds the
        whole averaged gradient, so the norm is local and needs no collective."""
        clip_grads_([p.grad for p in self.params], self.ctx.run.clip_grad)

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self._sync:
            return
        b = self._bucket_of[p]
        b.ready += 1
        if b.ready == len(b.params):
            b.buffer.div_(self.dp_size)
            b.work = dist.all_reduce(b.buffer, group=self.group, async_op=True)

    def train_step(self, inputs, targets, step):
        m = self.ctx.layout.num_microbatches
        mbs = self.local_microbatches(inputs, targets)
        for b in self.buckets:
            b.reset()
        tl = self.ctx.timeline
        total = 0.0
        for i, (xm, ym) in enumerate(mbs):
            self._sync = i == m - 1
            total += self.forward_backward(self.model, xm, ym, i)
        with tl.span("wait"):
            for b in self.buckets:
                if b.work is not None:
                    b.work.wait()
        with tl.span("optim"):
            self.clip()
            self.opt.step()
        return self.reduce_loss(total / self.dp_size, self.group)

    @classmethod
    def predict(cls, case: CaseConfig) -> Prediction:
        return ddp_prediction(case)


def ddp_prediction(case: CaseConfig) -> Prediction:
    """The bucket rule's all-reduces and a full replica's states
    (``parbench.analytic.data_parallel.ddp``)."""
    par = case.layout
    pred = data_parallel.ddp(shape_from(case.model), par.dp, case.options.data.bucket_mb, 4,
                             case.run.optimizer)
    return Prediction.uniform(par.dp, pred.wire_bytes, pred.states, pred.calls, **pred.figures)
