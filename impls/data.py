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

from fractions import Fraction

import torch
import torch.distributed as dist

from parbench.config import CaseConfig
from parbench.model import build_model, make_optimizer
from parbench.scheme import register

from .common import DataParallelScheme, ReplicaMixin, optimizer_state_bytes, optimizer_tensors


def bucket_assignment(sizes: list[int], cap_elems: int) -> list[list[int]]:
    """Indices (in reverse order) grouped into buckets of at least ``cap_elems`` elements,
    the last bucket taking the remainder."""
    buckets, cur, cur_n = [], [], 0
    for i in reversed(range(len(sizes))):
        cur.append(i)
        cur_n += sizes[i]
        if cur_n >= cap_elems:
            buckets.append(cur)
            cur, cur_n = [], 0
    if cur:
        buckets.append(cur)
    return buckets


class _Bucket:
    def __init__(self, params: list[torch.nn.Parameter], dtype, device):
        self.params = params
        n = sum(p.numel() for p in params)
        self.buffer = torch.zeros(n, dtype=dtype, device=device)
        off = 0
        for p in params:
            p.grad = self.buffer[off:off + p.numel()].view_as(p)
            off += p.numel()
        self.ready = 0
        self.work = None


@register
class NativeDDP(ReplicaMixin, DataParallelScheme):
    name = "data.ddp"
    family = "data"
    description = "DDP: bucketed gradient all-reduce overlapping backward"
    uses = ("dp",)

    def __init__(self, ctx):
        super().__init__(ctx)
        self.model = build_model(ctx.model, ctx.run.seed).to(ctx.device)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        cap = max(1, int(ctx.parallel.bucket_mb * 2**20 / self.params[0].element_size()))
        self.buckets = [_Bucket([self.params[i] for i in idx], self.params[0].dtype, ctx.device)
                        for idx in bucket_assignment([p.numel() for p in self.params], cap)]
        self._bucket_of = {}
        for b in self.buckets:
            for p in b.params:
                self._bucket_of[p] = b
                p.register_post_accumulate_grad_hook(self._on_grad)
        self.opt = make_optimizer(self.params, ctx.run)
        self._sync = False

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self._sync:
            return
        b = self._bucket_of[p]
        b.ready += 1
        if b.ready == len(b.params):
            b.buffer.div_(self.d)
            b.work = dist.all_reduce(b.buffer, group=self.group, async_op=True)

    def train_step(self, inputs, targets, step):
        m = self.ctx.parallel.num_microbatches
        mbs = self.local_microbatches(inputs, targets)
        for b in self.buckets:
            b.buffer.zero_()
            b.ready, b.work = 0, None
        tl = self.ctx.timeline
        total = 0.0
        for i, (xm, ym) in enumerate(mbs):
            self._sync = i == m - 1
            with tl.span("F", mb=i):
                loss = self.model(xm, ym) / m
            with tl.span("B", mb=i):
                loss.backward()
            total += float(loss.detach())
        with tl.span("wait"):
            for b in self.buckets:
                if b.work is not None:
                    b.work.wait()
        with tl.span("optim"):
            self.opt.step()
        return self.reduce_loss(total / self.d, self.group)

    def state_tensors(self):
        return {"params": list(self.params), "grads": [b.buffer for b in self.buckets],
                "optimizer": optimizer_tensors(self.opt)}

    @classmethod
    def predict(cls, case: CaseConfig) -> dict:
        return ddp_prediction(case)


def ddp_prediction(case: CaseConfig, elem_bytes: int = 4) -> dict:
    """Model states of a full replica and the ring all-reduce of every gradient once."""
    from parbench.model import build_model as _bm
    model = _bm(case.model, case.run.seed)
    psi = sum(p.numel() for p in model.parameters())
    n_tensors = len(list(model.parameters()))
    d = case.parallel.dp
    wire = Fraction(2 * (d - 1), d) * psi * elem_bytes if d > 1 else 0
    return {"wire_bytes": {"dp": float(wire)},
            "model_state_bytes": {"params": psi * elem_bytes, "grads": psi * elem_bytes,
                                  "optimizer": optimizer_state_bytes(psi, n_tensors,
                                                                     case.run.optimizer)},
            "params": psi}
