"""Data parallelism as a user writes it: every rank holds the whole model and trains on its
slice of the global batch; after backward the gradients are averaged over the data-parallel
group with one all-reduce of a flat buffer, and each rank takes the same AdamW step.

    parbench verify scheme=my_ddp.ddp:MyDDP

Only parbench's public API is used (``from parbench import ...``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from parbench import (Scheme, SchemeContext, build_model, dp_slice, make_optimizer,
                      microbatches, unrecorded)


class MyDDP(Scheme):
    name = "my_ddp"
    family = "data"
    uses = ("dp",)
    description = "my DDP: the averaged gradients in one flat all-reduce, then AdamW"

    def __init__(self, ctx: SchemeContext):
        super().__init__(ctx)
        self.group = ctx.mesh.group("dp")
        self.dp_size = ctx.mesh.size("dp")
        self.dp_rank = ctx.mesh.index("dp")
        # the same seeded full weights as the golden run, and the run's optimizer
        self.model = build_model(ctx.model, ctx.run.seed).to(ctx.device)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = make_optimizer(self.params, ctx.run)

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor, step: int) -> float:
        dev = self.ctx.device
        x = dp_slice(inputs, self.dp_rank, self.dp_size).to(dev)
        y = dp_slice(targets, self.dp_rank, self.dp_size).to(dev)
        m = self.ctx.layout.num_microbatches
        self.opt.zero_grad(set_to_none=True)
        local = 0.0
        for xm, ym in microbatches(x, y, m):
            loss = self.model(xm, ym) / m  # the mean over this rank's batch
            loss.backward()
            local += float(loss.detach())
        self.average_gradients()
        self.opt.step()
        # the global mean loss, for the report: not this scheme's traffic
        total = torch.tensor([local / self.dp_size], dtype=torch.float64)
        with unrecorded():
            dist.all_reduce(total, group=self.group)
        return float(total.item())

    def average_gradients(self) -> None:
        """Every rank's gradients become the mean over the data-parallel ranks."""
        grads = [p.grad for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        flat.div_(self.dp_size)
        dist.all_reduce(flat, group=self.group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    def full_params(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.model.named_parameters()}

    def full_grads(self) -> dict[str, torch.Tensor]:
        return {n: p.grad.detach() for n, p in self.model.named_parameters()}
