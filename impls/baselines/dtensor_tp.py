"""PyTorch DTensor tensor parallelism (``parallelize_module`` with ``ColwiseParallel`` /
``RowwiseParallel`` / ``SequenceParallel`` and ``loss_parallel``) on the reference GPT,
compared with ``tensor.megatron`` and ``tensor.megatron-sp``.

The plan is torchtitan's for Llama (``parallelize_llama``'s ``apply_tp``), on the reference
model's modules: the token embedding row-wise (vocab-parallel), QKV and fc1 column-wise, the
attention projection and fc2 row-wise, the LM head column-wise with its logits left sharded
along the vocabulary for ``loss_parallel``. With sequence parallelism the LayerNorms are
``SequenceParallel``, the row-wise outputs are ``Shard(1)`` (reduce-scatter), the attention
and MLP inputs are all-gathered (``PrepareModuleInput``) and the embedding's output is
scattered along the sequence after the position embedding is added.

Two changes to the reference model, both what torchtitan does for its own attention: the
fused QKV projection's rows are permuted so that a contiguous column-wise shard holds whole
heads (rank r's Q, K and V rows of its heads -- Megatron's head split; the full tensors are
permuted back for the verdict), and the attention merges its *local* heads. The vocabulary
is not padded: DTensor shards it unevenly. The optimizer steps the DTensors' local tensors
(elementwise AdamW, as the FSDP2 baseline does). Its traffic goes through the functional
collectives, which the ledger records.
"""
from __future__ import annotations

import types
import warnings

import torch
import torch.nn.functional as F

from parbench import comm
from parbench.config import CaseConfig, ConfigError
from parbench.model import build_model, make_optimizer
from parbench.scheme import register

from impls.tensor.megatron import MegatronFigures
from impls.tensor.megatron_model import MegatronLayout

warnings.filterwarnings("ignore", message=".*loss_parallel.*")


def qkv_permutation(cfg, tp: int) -> torch.Tensor:
    """Rows of the fused QKV weight in the order that makes contiguous shards head-aligned:
    rank 0's Q, K, V rows of its heads, then rank 1's, ..."""
    layout = MegatronLayout(cfg, tp)
    return torch.cat([layout.qkv_rows(r) for r in range(tp)])


def _local_heads_attention(self, x):
    """The reference attention on this rank's heads (the QKV output is a local shard)."""
    b, s, _ = x.shape
    qkv = self.qkv(x)
    hd = self.head_dim
    heads = qkv.shape[-1] // (3 * hd)
    q, k, v = qkv.view(b, s, 3, heads, hd).unbind(2)
    y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                       v.transpose(1, 2), is_causal=True)
    return self.proj(y.transpose(1, 2).reshape(b, s, heads * hd))


def tp_plan(model, sp: bool) -> dict:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   PrepareModuleOutput, RowwiseParallel,
                                                   SequenceParallel)
    plan = {"embed.tok": RowwiseParallel(input_layouts=Replicate())}
    if sp:
        plan["embed"] = PrepareModuleOutput(output_layouts=Replicate(),
                                            desired_output_layouts=Shard(1))
        plan["head.ln"] = SequenceParallel()
        plan["head.out"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                                           use_local_output=False)
    else:
        plan["head.out"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    for i in model.blocks:
        pre = f"blocks.{i}"
        plan[f"{pre}.attn.qkv"] = ColwiseParallel()
        plan[f"{pre}.mlp.fc1"] = ColwiseParallel()
        if sp:
            plan[f"{pre}.ln1"] = SequenceParallel()
            plan[f"{pre}.ln2"] = SequenceParallel()
            plan[f"{pre}.attn"] = PrepareModuleInput(input_layouts=(Shard(1),),
                                                     desired_input_layouts=(Replicate(),))
            plan[f"{pre}.mlp"] = PrepareModuleInput(input_layouts=(Shard(1),),
                                                    desired_input_layouts=(Replicate(),))
            plan[f"{pre}.attn.proj"] = RowwiseParallel(output_layouts=Shard(1))
            plan[f"{pre}.mlp.fc2"] = RowwiseParallel(output_layouts=Shard(1))
        else:
            plan[f"{pre}.attn.proj"] = RowwiseParallel()
            plan[f"{pre}.mlp.fc2"] = RowwiseParallel()
    return plan


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


@register
class DTensorTP(MegatronFigures):
    name = "baseline.dtensor.tp"
    baseline_of = "tensor.megatron"
    description = "torch DTensor parallelize_module: Colwise/Rowwise + loss_parallel"
    options = ()
    sp = False

    def build_model(self):
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor.parallel import parallelize_module
        ctx = self.ctx
        cfg = ctx.model
        model = build_model(cfg, ctx.run.seed).to(ctx.device)
        self.perm = qkv_permutation(cfg, self.tp)
        with torch.no_grad():
            for blk in model.blocks.values():
                blk.attn.qkv.weight.copy_(blk.attn.qkv.weight[self.perm])
                blk.attn.qkv.bias.copy_(blk.attn.qkv.bias[self.perm])
                blk.attn.head_dim = cfg.hidden_size // cfg.num_heads
                blk.attn.forward = types.MethodType(_local_heads_attention, blk.attn)
        self.mesh = DeviceMesh.from_group(self.group, ctx.device.type)
        parallelize_module(model, self.mesh, tp_plan(model, self.sp))
        if cfg.tie_embeddings:
            model.head.out.weight = model.embed.tok.weight
        self.install_layer_probes(list(model.blocks.values()))
        return model

    def make_optimizer(self, params):
        self.local = [_local(p).detach() for p in params]
        return make_optimizer(self.local, self.ctx.run)

    @classmethod
    def check(cls, case: CaseConfig) -> None:
        super().check(case)
        if case.options.recompute != "none":
            raise ConfigError(f"recompute={case.options.recompute} is not used by {cls.name}")
        if cls.sp and case.model.seq_length % case.layout.tp:
            raise ConfigError(f"tp={case.layout.tp} does not divide "
                              f"seq_length={case.model.seq_length}")

    def forward(self, inputs, targets):
        from torch.distributed.tensor.parallel import loss_parallel
        with loss_parallel():
            return self.model(inputs, targets)

    def backward(self, loss):
        from torch.distributed.tensor.parallel import loss_parallel
        with loss_parallel():
            loss.backward()

    def after_backward(self) -> None:
        for p, loc in zip(self.params, self.local):
            g = p.grad
            if g is not None and hasattr(g, "placements") and g.placements != p.placements:
                g = g.redistribute(p.device_mesh, p.placements)
            loc.grad = _local(g) if g is not None else None

    def _full(self, grads: bool):
        out = {}
        with comm.unrecorded():
            for name, p in self.model.named_parameters():
                t = p.grad if grads else p
                if t is None:
                    t = torch.zeros_like(p)
                if hasattr(t, "full_tensor"):
                    t = t.full_tensor()
                t = t.detach().clone()
                if name.endswith("attn.qkv.weight") or name.endswith("attn.qkv.bias"):
                    full = torch.empty_like(t)
                    full[self.perm] = t
                    t = full
                out[name] = t
        return out


@register
class DTensorSP(DTensorTP):
    name = "baseline.dtensor.sp"
    baseline_of = "tensor.megatron-sp"
    description = "torch DTensor parallelize_module: SequenceParallel + Colwise/Rowwise"
    sp = True
