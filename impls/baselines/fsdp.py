"""PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``) on the same case, compared with
``zero.3`` (Zhao et al. 2023, "PyTorch FSDP"; the ZeRO-3 scheme of Rajbhandari et al. 2020).

Each transformer block is one FSDP unit and the root (embedding, final LN, LM head) another,
on a 1-D ``DeviceMesh`` made from the mesh's dp group. Parameters become DTensors sharded on
dim 0. AdamW (``foreach=False``, elementwise) steps the DTensors' local shards directly (the
same arithmetic as stepping the DTensors, without DTensor's per-op dispatch, whose outputs
parbench's CPU memory tracker cannot read and whose overhead would dominate a tiny model's
step). Gradients are reduce-scattered every
micro-batch and accumulate in the sharded ``.grad``. With ``dtype=bf16`` a
``MixedPrecisionPolicy`` gathers bf16 parameters and reduces bf16 gradients; the sharded fp32
parameters are the master weights. With ``clip_grad``, ``torch.nn.utils.clip_grad_norm_``
runs on the sharded DTensor gradients, as torchtitan clips under FSDP2 (DTensor computes the
norm of the shards and all-reduces it over the mesh).

FSDP2 runs stock: its default collectives call ``dist.all_gather_single`` /
``dist.reduce_scatter_single``, which parbench's ledger wraps, so its traffic lands in the
ledger with nothing installed in FSDP2.
"""
from __future__ import annotations

import warnings

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from parbench.config import CaseConfig
from parbench.model import build_model, make_optimizer
from parbench.scheme import register

from impls.data.base import DataParallelScheme
from impls.zero.prediction import paper_prediction

warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*is deprecated")
warnings.filterwarnings("ignore", message=".*reduce_scatter_tensor.*is deprecated")


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


@register
class TorchFSDP2(DataParallelScheme):
    name = "baseline.torch.fsdp2"
    family = "data"
    baseline_of = "zero.3"
    description = "torch FSDP2 fully_shard (one unit per block + root)"
    uses = ("dp",)
    supports_clip_grad = True

    def __init__(self, ctx):
        super().__init__(ctx)
        mesh = DeviceMesh.from_group(self.group, ctx.device.type)
        model = build_model(ctx.model, ctx.run.seed).to(ctx.device)
        mp = MixedPrecisionPolicy()
        if ctx.run.dtype == "bf16":
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        units = [fully_shard(blk, mesh=mesh, mp_policy=mp) for blk in model.blocks.values()]
        units.append(fully_shard(model, mesh=mesh, mp_policy=mp))
        self.model = model
        self.params = list(model.parameters())
        self.local = [p.to_local().detach() for p in self.params]
        self.opt = make_optimizer(self.local, ctx.run)

    def train_step(self, inputs, targets, step):
        mbs = self.local_microbatches(inputs, targets)
        self.model.zero_grad(set_to_none=True)
        tl = self.ctx.timeline
        total = 0.0
        for i, (xm, ym) in enumerate(mbs):
            total += self.forward_backward(self.model, xm, ym, i)
        with tl.span("optim"):
            if self.ctx.run.clip_grad:  # on the sharded DTensor gradients: FSDP2's own norm
                torch.nn.utils.clip_grad_norm_(self.params, self.ctx.run.clip_grad)
            for p, loc in zip(self.params, self.local):
                loc.grad = p.grad.to_local() if p.grad is not None else None
            self.opt.step()
            for loc in self.local:
                loc.grad = None
        return self.reduce_loss(total / self.dp_size, self.group)

    def full_params(self):
        return {n: p.full_tensor().detach().float() for n, p in self.model.named_parameters()}

    def full_grads(self):
        return {n: p.grad.full_tensor().detach().float()
                for n, p in self.model.named_parameters()}

    @classmethod
    def predict(cls, case: CaseConfig):
        return paper_prediction(case, 3)
