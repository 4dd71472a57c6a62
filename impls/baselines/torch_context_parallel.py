"""PyTorch's context parallelism (``torch.distributed.tensor.experimental.context_parallel``,
ring attention on DTensor) on the same case, with torch DDP over dp x cp for the gradients --
the way torchtitan composes them (there with FSDP over ``dp_shard_cp``).

``context_parallel(cp_mesh, buffers=[tokens, targets, positions], buffer_seq_dims=[1, 1, 1])``
shards the local batch in place along the sequence with torch's head-tail load balancer (the
zig-zag layout of ``context.ring-attention``), and patches ``F.scaled_dot_product_attention``
so that the reference model's own attention runs as ring attention over the cp group. The
position embeddings are those of each rank's tokens (the sharded ``positions`` buffer).

On CPU it does not run out of the box: SDPA dispatches to
``aten._scaled_dot_product_flash_attention_for_cpu`` (and its backward), for which context
parallel registers neither a handler nor a sharding strategy, so a DTensor SDPA raises. This
module registers both CPU ops in context parallel's private handler table
(``_context_parallel._attention.custom_ops``), each calling torch's own
``_templated_ring_attention`` / ``_templated_ring_attention_backward`` with the CPU kernel --
the algorithm, rotation (torch's default: one all-gather of K/V per attention) and merge are
torch's; only the dispatch entry is added. CUDA needs no such entry.

Gradients: DDP over the ``dp_cp`` group averages over cp x dp ranks; each rank's loss is its
token mean. As in ``baseline.torch.ddp``, every step routes DDP's buckets through
``dist.all_reduce`` (the stock all-reduce hook) so the ledger sees them, the timed steps
included (issue 20: their ledgers are verified too). Traffic differs from the native ring
attention's closed form (torch gathers K/V and rotates dK/dV with all-to-alls): a finding,
shown beside it.
"""
from __future__ import annotations

import contextlib
import gc

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from parbench.batching import dp_slice
from parbench.config import CaseConfig, ConfigError
from parbench.model import build_model, make_optimizer
from parbench.scheme import Scheme, register

from impls.context.schemes import RingAttentionScheme
from impls.context.shard import embed

_REGISTERED = False


def register_cpu_sdpa() -> None:
    """Add the CPU flash-attention ops to context parallel's handler table (idempotent)."""
    global _REGISTERED
    if _REGISTERED:
        return
    import torch.distributed.tensor.experimental._context_parallel._attention as cp_attn
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Shard

    aten = torch.ops.aten
    seq_dim = 2

    def wrap(t, mesh):
        return DTensor.from_local(t, mesh, [Shard(seq_dim)], run_check=False)

    def forward(op_call, args, kwargs):
        names = ("query", "key", "value", "dropout_p", "is_causal")
        a = {**dict(zip(names, args)), **kwargs}
        mesh = a["query"].device_mesh
        out, lse = cp_attn._templated_ring_attention(
            mesh.get_group(), seq_dim, aten._scaled_dot_product_flash_attention_for_cpu,
            a["query"].to_local(), a["key"].to_local(), a["value"].to_local(),
            is_causal=a.get("is_causal", False), dropout_p=a.get("dropout_p", 0.0),
            scale=a.get("scale"))
        return wrap(out, mesh), wrap(lse, mesh)

    def backward(op_call, args, kwargs):
        names = ("grad_out", "query", "key", "value", "out", "logsumexp", "dropout_p",
                 "is_causal")
        a = {**dict(zip(names, args)), **kwargs}
        mesh = a["query"].device_mesh
        local = {k: a[k].to_local() for k in names[:6]}
        grads = cp_attn._templated_ring_attention_backward(
            mesh.get_group(), seq_dim, aten._scaled_dot_product_flash_attention_for_cpu_backward,
            local["grad_out"], "grad_out", local["query"], local["key"], local["value"],
            local["out"], local["logsumexp"], is_causal=a["is_causal"],
            dropout_p=a["dropout_p"], scale=a.get("scale"))
        return tuple(wrap(g, mesh) for g in grads[:3])

    cp_attn.custom_ops[aten._scaled_dot_product_flash_attention_for_cpu.default] = forward
    cp_attn.custom_ops[aten._scaled_dot_product_flash_attention_for_cpu_backward.default] = \
        backward
    _REGISTERED = True


class _GPTOnPositions(torch.nn.Module):
    """The reference GPT, position embeddings taken at given positions."""

    def __init__(self, gpt):
        super().__init__()
        self.gpt = gpt

    def forward(self, tokens, pos, targets):
        x = embed(self.gpt, tokens, pos)
        for blk in self.gpt.blocks.values():
            x = blk(x)
        return self.gpt.head(x, targets)


@register
class TorchContextParallel(RingAttentionScheme):
    name = "baseline.torch.context_parallel"
    baseline_of = "context.ring-attention"
    options = ()
    description = "torch context_parallel (ring attention on DTensor) + DDP over dp x cp"

    @classmethod
    def check(cls, case: CaseConfig) -> None:
        super().check(case)
        p, o = case.layout, case.options
        if o.context.cp_balance != "zigzag" or o.recompute != "none":
            raise ConfigError(f"cp_balance={o.context.cp_balance!r} recompute={o.recompute!r}: "
                              f"{cls.name} runs torch's head-tail (zigzag) layout, no "
                              "recomputation")
        if case.model.seq_length % (2 * p.cp):
            raise ConfigError(f"2*cp={2 * p.cp} must divide seq_length="
                              f"{case.model.seq_length} (torch's head-tail load balancer)")

    def __init__(self, ctx):
        Scheme.__init__(self, ctx)
        from torch.distributed.device_mesh import DeviceMesh
        register_cpu_sdpa()
        mesh = ctx.mesh
        self.cp, self.dp = mesh.size("cp"), mesh.size("dp")
        self.dp_rank = mesh.index("dp")
        self.grad_group = mesh.group("dp_cp")
        self.cp_mesh = DeviceMesh.from_group(mesh.group("cp"), ctx.device.type)
        self.gpt = build_model(ctx.model, ctx.run.seed).to(ctx.device)
        self.module = _GPTOnPositions(self.gpt)
        self.opt = make_optimizer(self.gpt.parameters(), ctx.run)
        self.ddp = None
        self._wrap(accounted=True)

    def _wrap(self, accounted: bool) -> None:
        self.ddp = None
        gc.collect()  # the old reducer's hooks go with it
        self.ddp = DistributedDataParallel(self.module, process_group=self.grad_group)
        if accounted:
            self.ddp.register_comm_hook(self.grad_group, default_hooks.allreduce_hook)
        self.accounted = accounted

    def train_step(self, inputs, targets, step):
        from torch.distributed.tensor.experimental import context_parallel
        # every step, timed ones included, keeps the stock all-reduce hook: the timed steps'
        # ledgers are verified too (issue 20), and the C++ path would pass the ledger by
        dev = self.ctx.device
        x = dp_slice(inputs, self.dp_rank, self.dp).to(dev).clone()
        y = dp_slice(targets, self.dp_rank, self.dp).to(dev).clone()
        pos = torch.arange(x.shape[1], device=dev).expand_as(x).clone()
        m = self.ctx.layout.num_microbatches
        tl = self.ctx.timeline
        self.opt.zero_grad(set_to_none=False)
        total = 0.0
        with context_parallel(self.cp_mesh, buffers=[x, y, pos], buffer_seq_dims=[1, 1, 1],
                              no_restore_buffers={x, y, pos}), torch.enable_grad():
            for i, (xm, pm, ym) in enumerate(zip(x.chunk(m), pos.chunk(m), y.chunk(m))):
                last = i == m - 1
                with self.ddp.no_sync() if not last else contextlib.nullcontext():
                    with tl.span("F", mb=i):
                        loss = self.ddp(xm, pm[0], ym) / m
                    with tl.span("B", mb=i):
                        loss.backward()
                total += float(loss.detach())
        with tl.span("optim"):
            self.opt.step()
        return self.reduce_loss(total / (self.cp * self.dp), self.grad_group)

    def full_params(self):
        return {n: p.detach() for n, p in self.gpt.named_parameters()}

    def full_grads(self):
        return {n: p.grad.detach() for n, p in self.gpt.named_parameters()}

    def metrics(self):
        return {}
