"""DeepSpeed-Ulysses on the same case: ``deepspeed.sequence.layer.DistributedAttention`` (Jacobs
et al. 2023) as every layer's attention, trained by a DeepSpeed engine that knows the sequence
parallel groups -- the way Megatron-DeepSpeed runs it.

The model is the reference GPT on the rank's contiguous sequence shard (``context.shard``);
``DistributedAttention(local_attention, cp group, scatter_idx=2, gather_idx=1)`` wraps a local
causal ``F.scaled_dot_product_attention`` over (b, s, heads/P, d) and does DeepSpeed's own
all-to-alls (``batch_dim_idx=0``). The engine (ZeRO stage 0, fp32, a client
``torch.optim.AdamW(foreach=False)``) is given an mpu whose sequence-parallel group is the
mesh's cp group and whose sequence-data-parallel group is ``dp_cp``: DeepSpeed all-reduces
the gradients over dp x cp and divides by dp only (it sums the sequence shards), so each
rank's loss is its token mean divided by cp -- the client's side of DeepSpeed's contract.

Checked steps read the reduced gradients before ``engine.step()`` (outside the ledger) into
``self.captured``, a ``KeptForChecks``: the tracker attributes it to ``checks``, so that the
model states measured on the rank are DeepSpeed's own (it frees the gradients after the step:
0 gradient bytes between steps) and the copy is still measured;
timed steps run the engine untouched. Each case gets fresh ranks (``isolated``: DeepSpeed
keeps process-global groups). Its traffic is in the ledger (``deepspeed.comm`` calls
``torch.distributed``); beside the native Ulysses prediction, a difference is a finding.
"""
from __future__ import annotations

import torch.nn.functional as F

from parbench import comm
from parbench.config import CaseConfig, ConfigError
from parbench.memory import KeptForChecks
from parbench.model import build_model
from parbench.scheme import Scheme, register

from impls.baselines.deepspeed_common import stage0_engine
from impls.baselines.deepspeed_zero import _import_deepspeed, _MeshMPU
from impls.context.layout import positions
from impls.context.schemes import UlyssesScheme
from impls.context.shard import ShardedGPT




class _SequenceMPU(_MeshMPU):
    """The mesh's groups under the names DeepSpeed's engine asks a sequence-parallel client
    for (``deepspeed.utils.groups``)."""

    def get_sequence_parallel_group(self):
        return self.mesh.group("cp")

    def get_sequence_parallel_world_size(self):
        return self.mesh.size("cp")

    def get_sequence_parallel_rank(self):
        return self.mesh.index("cp")

    def get_sequence_data_parallel_group(self):
        return self.mesh.group("dp_cp")

    def get_sequence_data_parallel_world_size(self):
        return self.mesh.size("dp_cp")

    def get_sequence_data_parallel_rank(self):
        return self.mesh.index("dp_cp")


def _local_attention(q, k, v):
    """(b, s, heads/P, d) each -> the same layout: causal SDPA over the whole sequence."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                         v.transpose(1, 2), is_causal=True)
    return out.transpose(1, 2)


class _DistributedAttentionCore:
    def __init__(self, attn):
        self.attn = attn

    def __call__(self, q, k, v):
        b, n, heads, d = q.shape
        return self.attn(q, k, v, 0).reshape(b, n, heads * d)


@register
class DeepSpeedUlysses(UlyssesScheme):
    name = "baseline.deepspeed.ulysses"
    baseline_of = "context.ulysses"
    kind = "ulysses"
    isolated = True
    options = ()
    description = "DeepSpeed DistributedAttention (Ulysses) + engine over dp x cp"

    @classmethod
    def check(cls, case: CaseConfig) -> None:
        super().check(case)
        if case.options.recompute != "none":
            raise ConfigError(f"recompute={case.options.recompute!r}: {cls.name} runs "
                              "recompute=none")
        if case.run.optimizer != "adamw":
            raise ConfigError(f"optimizer={case.run.optimizer!r}: {cls.name} runs adamw only")

    def __init__(self, ctx):
        Scheme.__init__(self, ctx)  # not the native __init__: the engine owns grads and optimizer
        ds = _import_deepspeed()
        from deepspeed.sequence.layer import DistributedAttention
        mesh = ctx.mesh
        self.cp, self.cp_rank = mesh.size("cp"), mesh.index("cp")
        self.dp, self.dp_rank = mesh.size("dp"), mesh.index("dp")
        self.grad_group = mesh.group("dp_cp")
        gpt = build_model(ctx.model, ctx.run.seed).to(ctx.device)
        attn = DistributedAttention(_local_attention, mesh.group("cp"), scatter_idx=2,
                                    gather_idx=1)
        module = ShardedGPT(gpt, _DistributedAttentionCore(attn))
        self.engine = stage0_engine(ds, module, ctx, _SequenceMPU(mesh))
        self.captured = KeptForChecks()  # the gradients a checked step used (full_grads)

    def _named(self):
        return [(n.removeprefix("gpt."), p) for n, p in self.engine.module.named_parameters()]

    def token_positions(self):
        return positions(self.ctx.model.seq_length, self.cp, self.cp_rank)

    def train_step(self, inputs, targets, step):
        pos, mbs = self.local_batch(inputs, targets)
        m = len(mbs)
        tl = self.ctx.timeline
        total = 0.0
        for i, (xm, ym) in enumerate(mbs):
            with tl.span("F", mb=i):
                loss = self.engine(xm, pos, ym) / self.cp
            with tl.span("B", mb=i):
                self.engine.backward(loss)
            total += float(loss.detach()) * self.cp / m
            if i == m - 1 and step < self.ctx.run.steps:
                with comm.unrecorded():
                    self.captured = KeptForChecks(
                        (n, p.grad.detach().clone()) for n, p in self._named())
            with tl.span("optim" if i == m - 1 else "step", mb=i):
                self.engine.step()
        return self.reduce_loss(total / (self.cp * self.dp), self.grad_group)

    def full_params(self):
        return {n: p.detach().clone() for n, p in self._named()}

    def full_grads(self):
        return self.captured

    def metrics(self):
        return {}
