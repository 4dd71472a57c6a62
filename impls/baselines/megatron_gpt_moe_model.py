"""The model of ``baseline.megatron.gpt-moe`` (``megatron_gpt_moe``, whose docstring says
what it runs and why): Megatron-Core's ``GPTModel`` with MoE layers built from the case's
model, the reference weights placed on it (``MoELayout``: every expert MLP at its own width)
and read back under the reference's names (``unshard``, ``gather_full``)."""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from parbench import comm
from parbench.model.moe import is_moe_layer

from impls.baselines import megatron_moe
from impls.baselines.megatron_gpt import (GPTModelLayout, MegatronCoreGPTModel,
                                          SequenceParallelTorchNorm, mcore_name, with_norm)
from impls.tensor.shards import Placement, gather_full

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
    """A routed or shared expert's MLP placed as the dense MLP is (fc1 column-, fc2
    row-parallel, SwiGLU's [gate; up] per rank) at its own hidden size: the routed experts'
    ``moe_ffn_hidden_size`` over expert-tp (= tp, Megatron-Core's default), the shared
    expert's ``moe_shared_expert_size`` over tp (Megatron-Core's ``SharedExpertMLP`` is an
    ``MLP`` of ``moe_shared_expert_intermediate_size``). Placed at the dense width, a
    fine-grained or shared expert's fc1 would read rows past its own (zero padding)."""

    def placement(self, name: str, shape: tuple) -> Placement:
        width = self.expert_width(name)
        if width is None:
            return super().placement(name, shape)
        return self.width_layout(name, width).placement(name, shape)

    def width_layout(self, name: str, width: int) -> GPTModelLayout:
        """The dense placement of a model whose MLP is ``width`` wide (a self-test mutant
        swaps it for one expert MLP)."""
        return GPTModelLayout(dataclasses.replace(self.cfg, ffn_hidden_size=width), self.tp)

    def expert_width(self, name: str) -> int | None:
        """The hidden size of the expert MLP ``name`` belongs to (None: not an expert's)."""
        if ".mlp.experts." in name:
            return self.cfg.moe_ffn_hidden_size or self.cfg.ffn
        if ".mlp.shared_expert." in name:
            return self.cfg.moe_shared_expert_size
        return None


def router_fields(cfg) -> dict:
    """DeepSeek-V3's router (``parbench.model.router``) as Megatron-Core's
    ``TransformerConfig`` fields: the score function, the balancing bias and its rate
    (updated by ``finalize_model_grads``' ``_update_router_expert_bias``), the groups and
    the routed gates' scaling."""
    return {"moe_router_score_function": cfg.moe_router,
            "moe_router_enable_expert_bias": bool(cfg.moe_bias_update_rate),
            "moe_router_bias_update_rate": cfg.moe_bias_update_rate,
            "moe_router_num_groups": cfg.moe_router_groups or None,
            "moe_router_group_topk": cfg.moe_router_topk_groups or None,
            "moe_router_topk_scaling_factor": (cfg.moe_router_scaling
                                               if cfg.moe_router_scaling != 1.0 else None)}


class MegatronCoreMoEGPT(MegatronCoreGPTModel):
    """GPTModel with MoE layers (``MoELayer``); this rank's experts of every one (their
    expert-tp shard: expert-tp = tp, the same ranks as the tp group)."""

    layout_cls = MoELayout

    def __init__(self, cfg, seed: int, mesh, ep: int, ep_rank: int, sp: bool = False):
        self.ep, self.first = ep, ep_rank * (cfg.num_experts // ep)
        self.local = cfg.num_experts // ep
        pg = megatron_moe.process_groups(mesh)
        one = [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]
        pg.pp = pg.embd = pg.pos_embd = one
        self.tp_group = mesh.group("tp")
        super().__init__(cfg, seed, mesh.group("tp"), mesh.size("tp"), mesh.index("tp"), sp,
                         pg=pg)

    def build_config(self, cfg, tp: int, sp: bool):
        moe = megatron_moe.transformer_config(cfg, self.ep)
        base = super().build_config(cfg, tp, sp)
        return dataclasses.replace(
            base, **{f: getattr(moe, f) for f in MOE_FIELDS},
            moe_layer_freq=[int(is_moe_layer(cfg, i)) for i in range(cfg.num_layers)],
            moe_ffn_hidden_size=cfg.moe_ffn_hidden_size or cfg.ffn,
            moe_shared_expert_intermediate_size=cfg.moe_shared_expert_size or None,
            **router_fields(cfg))

    def layer_spec(self, conf):
        """Megatron-Core's decoder block spec: a local MoE or dense layer spec per layer, as
        its ``moe_layer_freq`` says (``build_config``); under sequence parallelism every norm
        shim 5's, the final one too."""
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
        block = get_gpt_decoder_block_spec(conf, use_transformer_engine=False,
                                           normalization=conf.normalization, pp_rank=0)
        if not conf.sequence_parallel:
            return block
        norm = SequenceParallelTorchNorm
        return dataclasses.replace(block, layer_norm=norm,
                                   layer_specs=[with_norm(s, norm) for s in block.layer_specs])

    def adapt(self) -> None:
        for layer in self.gpt.decoder.layers:
            if hasattr(layer.mlp, "router"):
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
        """The rank's parameters (or gradients) under the reference's names and row order,
        whole: its tp shards gathered over tp (collective, outside the ledger; the experts'
        expert-tp group has the tp group's ranks)."""
        named = {n: ((p.grad if grads else p).detach(), pl)
                 for n, (p, pl) in self.shards().items()}
        if self.tp == 1:  # one rank holds every row: Megatron's row order put back
            return {n: t if pl.replicated else unshard(t, pl.index(0), pl.full_shape)
                    for n, (t, pl) in named.items()}
        with comm.unrecorded():
            return gather_full(named, self.tp_group, dist.get_process_group_ranks(
                self.tp_group), self.tp_group.rank())

    def sequence_parallel_grads(self) -> list[torch.Tensor]:
        """The gradients of the parameters Megatron marks ``sequence_parallel`` (the norms,
        shim 5, and every router): partial sums over the tp ranks' sequence shards."""
        return [p.grad for p in self.gpt.parameters()
                if getattr(p, "sequence_parallel", False) and p.grad is not None]
