"""Megatron-Core 0.16's whole ``GPTModel`` with MoE layers under expert parallelism, against
``expert.alltoall`` (issue 21): ``baseline.megatron.gpt-moe``.

The model is ``baseline.megatron.gpt``'s (``megatron_gpt.MegatronCoreGPTModel``: the local
layer spec, the case's model as a ``TransformerConfig``, the reference weights mapped by
name) with ``num_moe_experts`` set, so that ``get_gpt_layer_local_spec(num_experts=E,
moe_grouped_gemm=False)`` makes every layer's MLP Megatron-Core's ``MoELayer`` (``TopKRouter``,
``MoEAlltoAllTokenDispatcher``, ``SequentialMLP`` experts). The MoE settings, their CPU shims
and the comparable cases are ``baseline.megatron.moe``'s (``megatron_moe``: capacity mode --
dropless split sizes break gloo --, router without bias, top-1 pre-softmax, the Switch and
z-losses through ``MoEAuxLossAutoScaler`` at 1/m, ep >= 2, nothing dropped); here Megatron
also runs the attention, norms, embedding, rotary and vocab-parallel cross-entropy around
them (tp = 1: ``expert.alltoall``'s degrees are ep and dp; tp x ep cannot run here, since
Megatron-Core's ``MoELayer`` raises in training when tp > 1 without sequence parallelism,
which the local spec's norm refuses). Fine-grained experts
(``moe_ffn_hidden_size``) run; a shared expert does not (its ``SharedExpertMLP`` refuses
biases, which the expert family's experts have: refused in ``check``). Expert e of E sits
on ep rank e // (E/ep) as local expert e mod (E/ep) (Megatron-Core's ``SequentialMLP``: the
``local_expert_indices`` of its ep rank are contiguous).

Process groups: the mesh's (``megatron_moe.process_groups``: tp, cp, dp, ep and the expert
groups), one-rank groups for pp and the embedding groups (no pipeline). Gradients are reduced
as ``expert.alltoall`` does (dense over dp, experts over edp; Megatron's DDP is not used),
as by ``baseline.megatron.moe``. The verdict sees the reference's names and row order: the
linear_qkv rows are Megatron's group-interleaved order, put back (``unshard``).

Measured (tiny, E = 4, top-1, ep = dp = 2, m = 2; the same as ``baseline.megatron.moe``):
equivalent to the golden run; 24 all-to-alls per rank and step where ``expert.alltoall``'s
closed form has 16, ep wire bytes 133,120 against 131,072 (+2,048 = 2 L m (ep-1)/ep E C 4 B,
L = 2 MoE layers, C = 32: the gate probabilities each way), the dp all-reduce exactly the
closed form (70,912 B); its cross-entropy's all-reduces on the one-rank tp group (6 calls,
no wire bytes); 3,520 B of ``other`` model state (the dispatcher's routing tensors).

Optional: ``pip install -e ".[megatron]"``; without megatron-core the scheme reports itself
unavailable. Each case runs in fresh processes (``isolated``).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn as nn

from parbench.config import CaseConfig, ConfigError
from parbench.scheme import register

from impls.baselines import megatron_moe
from impls.baselines.megatron_gpt import (GPTModelLayout, MegatronCoreGPTModel, mcore_name,
                                          no_cuda_rng_fork)
from impls.baselines.megatron_moe import MegatronMoE
from impls.baselines.megatron_tp import _set_parallel_state
from impls.tensor.shards import Placement

#: the MoE fields of ``megatron_moe.transformer_config`` taken into the GPTModel's config
MOE_FIELDS = ("num_moe_experts", "moe_router_topk", "moe_router_pre_softmax",
              "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_z_loss_coeff",
              "moe_router_dtype", "moe_token_dispatcher_type", "moe_expert_capacity_factor",
              "moe_pad_expert_input_to_capacity", "moe_token_drop_policy",
              "expert_model_parallel_size", "bias_activation_fusion")


def unshard(local: torch.Tensor, index: tuple, shape: tuple) -> torch.Tensor:
    """The full tensor of which ``local`` is ``shards.take(full, index)`` (one rank holds
    every row: a permutation, padded rows dropped)."""
    out = local
    for dim, ix in enumerate(index):
        if ix is None:
            continue
        keep = ix < shape[dim]
        full = out.new_zeros([shape[dim] if d == dim else n for d, n in enumerate(out.shape)])
        out = full.index_copy_(dim, ix[keep], out.index_select(dim, keep.nonzero()[:, 0]))
    return out


class MoELayout(GPTModelLayout):
    """tp = 1: an expert's weights are whole on its ep rank (the dense MLP's row placement
    would read a fine-grained expert's rows at the dense width)."""

    def placement(self, name: str, shape: tuple) -> Placement:
        if ".mlp.experts." in name:
            return Placement(name, shape)
        return super().placement(name, shape)


class MegatronCoreMoEGPT(MegatronCoreGPTModel):
    """GPTModel with every MLP an ``MoELayer``; this rank's experts of every layer."""

    layout_cls = MoELayout

    def __init__(self, cfg, seed: int, mesh, ep: int, ep_rank: int):
        self.ep, self.first = ep, ep_rank * (cfg.num_experts // ep)
        self.local = cfg.num_experts // ep
        pg = megatron_moe.process_groups(mesh)
        one = [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]
        pg.pp = pg.embd = pg.pos_embd = one
        super().__init__(cfg, seed, mesh.group("tp"), 1, 0, False, pg=pg)

    def build_config(self, cfg, tp: int, sp: bool):
        moe = megatron_moe.transformer_config(cfg, self.ep)
        base = super().build_config(cfg, tp, sp)
        return dataclasses.replace(
            base, **{f: getattr(moe, f) for f in MOE_FIELDS},
            moe_ffn_hidden_size=cfg.moe_ffn_hidden_size or cfg.ffn,
            moe_shared_expert_intermediate_size=cfg.moe_shared_expert_size or None)

    def layer_spec(self, conf):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        return get_gpt_layer_local_spec(num_experts=conf.num_moe_experts,
                                        moe_grouped_gemm=False,
                                        normalization=conf.normalization)

    def adapt(self) -> None:
        for layer in self.gpt.decoder.layers:
            layer.mlp.router.bias = None  # the reference router has no bias

    def mcore_name(self, ref: str) -> str | None:
        if ".mlp.router." in ref:
            return "decoder.layers." + ref[len("blocks."):]
        if ".mlp.shared_expert." in ref:
            return mcore_name(ref.replace(".mlp.shared_expert.", ".mlp.", 1)).replace(
                ".mlp.linear_", ".mlp.shared_experts.linear_")
        if ".mlp.experts." not in ref:
            return mcore_name(ref)
        head, tail = ref.split(".mlp.experts.")
        e, fc, leaf = tail.split(".")
        if not self.first <= int(e) < self.first + self.local:
            return None  # another ep rank's expert
        mine = {"fc1": "linear_fc1", "fc2": "linear_fc2"}[fc]
        return (f"decoder.layers.{head[len('blocks.'):]}.mlp.experts.local_experts."
                f"{int(e) - self.first}.{mine}.{leaf}")

    def reference_named(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """The rank's parameters (or gradients) under the reference's names and row order."""
        out = {}
        for name, (p, pl) in self.shards().items():
            t = (p.grad if grads else p).detach()
            out[name] = t if pl.replicated else unshard(t, pl.index(0), pl.full_shape)
        return out


@register
class MegatronCoreGPTMoE(MegatronMoE):
    name = "baseline.megatron.gpt-moe"
    #: DeepSeek-style experts Megatron-Core's local spec builds comparably (issue 21)
    moe_features = frozenset({"fine-grained", "llama-experts"})
    #: the LLaMA blocks and Mixtral's experts (SwiGLU, no biases), Megatron's own MLPs
    model_features = frozenset({"rope", "gqa", "rmsnorm", "swiglu", "no-bias"})
    model_cls = MegatronCoreMoEGPT
    description = ("Megatron-Core 0.16 GPTModel with MoELayer (local spec, alltoall "
                   "dispatcher, capacity mode) with the reference weights")

    @classmethod
    def check(cls, case: CaseConfig) -> None:
        m = case.model
        if m.moe_shared_expert_size:
            raise ConfigError(f"moe_shared_expert_size={m.moe_shared_expert_size}: Megatron-Core "
                              "0.16.1's SharedExpertMLP asserts 'bias is not supported in the "
                              "shared experts' (with biases), and without them its shared "
                              "expert's fc1 is not yet mapped (a size mismatch)")
        super().check(case)
        if m.moe_every != 1 or m.moe_first_dense:
            raise ConfigError(f"moe_every={m.moe_every}, moe_first_dense="
                              f"{m.moe_first_dense}: {cls.name} builds every layer as MoE "
                              "(local spec); set moe_every=1, moe_first_dense=0")
        if m.num_experts % case.layout.ep:
            raise ConfigError(f"ep={case.layout.ep} does not divide "
                              f"num_experts={m.num_experts}")

    def build_local_model(self) -> nn.Module:
        megatron_moe.install_cpu_shims()
        ctx = self.ctx
        _set_parallel_state(ctx.mesh.group("tp"), ctx.device)
        no_cuda_rng_fork()
        return self.model_cls(ctx.model, ctx.run.seed, ctx.mesh, self.ep, self.ep_rank)

    def named_parameters(self):
        return [(n, p) for n, (p, _) in self.model.shards().items()]

    def full_params(self):
        return self._gathered(self.model.reference_named())

    def full_grads(self):
        return self._gathered(self.model.reference_named(grads=True))
