"""Megatron-Core's GPTModel (``baseline.megatron.gpt``) loaded with a wrong weight mapping --
the classic bugs of converting a checkpoint to Megatron-Core's layout:

- ``linear_qkv`` filled as plain [Q; K; V] rows (each rank: its query heads, then its K
  heads, then its V heads) instead of Megatron-Core's group-interleaved order [q of group 0,
  k0, v0, q of group 1, ...] (Megatron-Core docs, ``SelfAttention``: the fused QKV is split
  per query group). With one query group per rank both orders coincide, so the case gives
  each tp rank two groups (MHA, num_kv_heads = num_heads = 4, tp = 2);
- SwiGLU's ``linear_fc1`` filled as [up; gate] instead of [gate; up] (Megatron-Core's
  ``glu``: the first half goes through the activation; Shazeer 2020, "GLU Variants Improve
  Transformer", Eq. 5 gates with the activated half).

- the MoE GPTModel's experts loaded round-robin (expert e on ep rank e mod ep) instead of
  Megatron-Core's contiguous ``local_expert_indices`` (e // (E/ep));
- DeepSeek-V3's routed scaling factor (2.5) not passed on as Megatron-Core's
  ``moe_router_topk_scaling_factor``;
- with deepseek-tiny's first dense layer, a parameter filter written for all-MoE models
  (an MLP parameter not the router's nor the shared expert's is an expert's): the dense
  MLP's gradients reduced over edp as an expert's, never averaged over dp;
- its shared expert's SwiGLU ``linear_fc1`` alone loaded as [up; gate] (deepseek-tiny as
  ``baseline.megatron.gpt-moe`` runs it: ``DEEPSEEK_TINY``);
- under tp x ep with sequence parallelism, the routers' gradients left out of the tp
  all-reduce of the ``sequence_parallel`` gradients (only the norms'): Megatron-Core's
  ``TopKRouter`` marks its weight ``sequence_parallel``, each tp rank routes its own
  sequence shard, so each steps its router on a partial gradient;
- a pipeline stage's GPTModel loaded with reference layers 0..L/p-1 on every stage: the
  layer offset (Megatron-Core's ``get_transformer_layer_offset``, r L/p) forgotten.
- the head tied across the stages, but the stage wrapper tells ``finalize_model_grads`` it is
  not (``share_embeddings_and_output_weights`` False): the two copies' gradients are never
  summed over the embedding group.
- under sequence parallelism, norms built without the ``sequence_parallel`` mark (a norm
  class that forgets it, as a port to another norm implementation can): each tp rank's norm
  gradient stays its sequence shard's part, never all-reduced by ``finalize_model_grads``.
- under context parallelism (CPU shim 6), RoPE applied at each rank's local positions
  0..s/cp-1 instead of the global positions of its two zig-zag chunks (Megatron-Core's
  ``get_pos_emb_on_this_cp_rank`` bypassed, as a rotary module that does not know cp does);
- under context parallelism, the micro-batch's loss each cp rank's own token mean, not the
  mean over the whole sequence (Megatron-LM's loss_func all-reduces the sum and count over
  cp): the schedule's multiplication by cp and DDP's average over dp x cp then give cp times
  the gradient;
- under context parallelism, Megatron's DDP given the data-parallel group without cp (a
  ``with_context_parallel=False`` slip): the gradients never summed over the cp ranks, each
  stepping on its own tokens' part.

The mutants need megatron-core: where it is not installed their scheme reports itself
unavailable and ``parbench selftest`` skips them, saying why.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace

import torch

from impls.baselines.megatron_gpt import (GPTModelLayout, MegatronCoreGPTModel,
                                          MegatronCoreGPTScheme, SequenceParallelTorchNorm,
                                          mcore_name, no_cuda_rng_fork,
                                          sequence_parallel_spec)
from impls.baselines.megatron_gpt_moe import DEEPSEEK_TINY, MegatronCoreGPTMoE
from impls.baselines.megatron_gpt_moe_model import MegatronCoreMoEGPT, MoELayout
from impls.baselines.megatron_gpt_ptdp import (MegatronCoreGPTPTDP, MegatronCoreGPTStage,
                                               _CudaMovesOnCpu, adopt_embedding_group)
from impls.baselines.megatron_ptdp import swap_group
from impls.tensor.megatron_model import MegatronLayout
from impls.tensor.shards import blocks

from .catalogue import mutant, with_model

LLAMA = {"model": "llama-tiny", "vocab_size": "128"}


class _PlainQKVLayout(GPTModelLayout):
    qkv_rows = MegatronLayout.qkv_rows  # the bug: [Q_r; K_r; V_r], not group-interleaved


class _PlainQKV(MegatronCoreGPTModel):
    layout_cls = _PlainQKVLayout


@mutant("mcore-gpt-qkv-plain-order", base="baseline.megatron.gpt",
        overrides={**LLAMA, "num_kv_heads": "4"},
        bug="linear_qkv loaded as plain [Q; K; V] rows, not Megatron's group-interleaved order")
class MCoreGPTQKVPlain(with_model(MegatronCoreGPTScheme, _PlainQKV)):
    pass


class _SwappedFc1Layout(GPTModelLayout):
    def fc1_rows(self, r: int) -> torch.Tensor:
        f, w = self.cfg.ffn, self.cfg.ffn // self.tp
        return torch.cat([blocks(f + r * w, w), blocks(r * w, w)])  # the bug: [up; gate]


class _SwappedFc1(MegatronCoreGPTModel):
    layout_cls = _SwappedFc1Layout


@mutant("mcore-gpt-fc1-halves-swapped", base="baseline.megatron.gpt", overrides=LLAMA,
        bug="SwiGLU linear_fc1 loaded as [up; gate] instead of Megatron's [gate; up]")
class MCoreGPTFc1Swapped(with_model(MegatronCoreGPTScheme, _SwappedFc1)):
    pass


class _StridedExperts(MegatronCoreMoEGPT):
    def mcore_name(self, ref: str) -> str | None:
        if ".mlp.experts." not in ref:
            return super().mcore_name(ref)
        head, tail = ref.split(".mlp.experts.")
        e, rest = tail.split(".", 1)
        if int(e) % self.ep != self.first // self.local:
            return None
        j = int(e) // self.ep  # the bug: expert e on ep rank e mod ep, not e // (E/ep)
        return (f"decoder.layers.{head[len('blocks.'):]}.mlp.experts.local_experts.{j}."
                + rest.replace("fc1", "linear_fc1").replace("fc2", "linear_fc2"))


class _SharedSwappedLayout(MoELayout):
    def width_layout(self, name: str, width: int):
        if ".mlp.shared_expert." not in name:
            return super().width_layout(name, width)
        # the bug: the shared expert's linear_fc1 as [up; gate] (the routed experts' right)
        return _SwappedFc1Layout(replace(self.cfg, ffn_hidden_size=width), self.tp)


class _SharedSwapped(MegatronCoreMoEGPT):
    layout_cls = _SharedSwappedLayout


@mutant("mcore-gpt-moe-shared-fc1-swapped", base="baseline.megatron.gpt-moe",
        overrides=DEEPSEEK_TINY,
        bug="the shared expert's SwiGLU linear_fc1 loaded as [up; gate] (a converter that "
            "orders DeepSeek's shared_experts gate/up projections apart from the routed ones)")
class MCoreGPTMoESharedSwapped(with_model(MegatronCoreGPTMoE, _SharedSwapped)):
    pass


class _RoutersNotReduced(MegatronCoreMoEGPT):
    def sequence_parallel_grads(self):
        # the bug: the norms' gradients only (the dense SP list), not the routers' that
        # Megatron's TopKRouter also marks sequence_parallel
        return [p.grad for n, p in self.gpt.named_parameters()
                if getattr(p, "sequence_parallel", False) and ".router." not in n]


@mutant("mcore-gpt-moe-tp-router-not-reduced", base="baseline.megatron.gpt-moe",
        overrides={**DEEPSEEK_TINY, "tp": "2", "sp": "true"},
        bug="under tp x ep with sequence parallelism the routers' gradients are not "
            "all-reduced over tp: each tp rank steps its router on its sequence shard's part")
class MCoreGPTMoERoutersNotReduced(with_model(MegatronCoreGPTMoE, _RoutersNotReduced)):
    pass


def _all_moe_filter(name: str) -> bool:
    # the bug: written when every layer was MoE -- an MLP parameter other than the router's
    # and the shared expert's is an expert's
    return ".mlp." in name and ".router." not in name and ".shared_expert." not in name


@mutant("mcore-gpt-moe-first-dense-as-experts", base="baseline.megatron.gpt-moe",
        overrides=DEEPSEEK_TINY,
        bug="a filter written for all-MoE models takes the first dense layer's MLP for "
            "experts: its gradients reduced over edp (1 here), never averaged over dp")
class MCoreGPTMoEFirstDenseAsExperts(MegatronCoreGPTMoE):
    expert_param = staticmethod(_all_moe_filter)


class _ScalingForgotten(MegatronCoreMoEGPT):
    def build_config(self, cfg, tp: int, sp: bool):
        # the bug: DeepSeek-V3's routed_scaling_factor not passed on to Megatron-Core
        return replace(super().build_config(cfg, tp, sp), moe_router_topk_scaling_factor=None)


@mutant("mcore-gpt-moe-router-scaling-forgotten", base="baseline.megatron.gpt-moe",
        overrides={**DEEPSEEK_TINY, "moe_router_scaling": "2.5"},
        bug="the routed gates' scaling factor (DeepSeek-V3's routed_scaling_factor) not set as "
            "Megatron-Core's moe_router_topk_scaling_factor: the gates sum to 1, not 2.5")
class MCoreGPTMoEScalingForgotten(with_model(MegatronCoreGPTMoE, _ScalingForgotten)):
    pass


@mutant("mcore-gpt-moe-experts-strided", base="baseline.megatron.gpt-moe",
        overrides={"moe_capacity_factor": "0"},
        bug="experts loaded round-robin (e on ep rank e mod ep), not Megatron's contiguous "
            "local_expert_indices")
class MCoreGPTMoEStrided(with_model(MegatronCoreGPTMoE, _StridedExperts)):
    pass


class _NoOffsetStage(MegatronCoreGPTStage):
    def mcore_name(self, ref: str) -> str | None:
        if not ref.startswith("blocks."):
            return super().mcore_name(ref)
        i = int(ref.split(".")[1])
        if i >= self.hi - self.lo:
            return None
        return mcore_name(ref)  # the bug: reference layer i as every stage's local layer i


@mutant("mcore-gpt-pp-no-layer-offset", base="baseline.megatron.gpt-ptdp",
        overrides={"model": "tiny-4l", "pp": "2", "dp": "1", "ep": "1", "etp": "0",
                   "num_experts": "0", "schedule": "1f1b", "steps": "2"},
        bug="every pipeline stage loads reference layers 0..L/p-1 (the layer offset ignored)")
class MCoreGPTPPNoOffset(MegatronCoreGPTPTDP):
    def build_stage(self, config, stage):
        no_cuda_rng_fork()
        return _NoOffsetStage(self.ctx.model, self.ctx.run.seed, self.group, self.tp,
                              self.tp_rank, stage, config)


class _UnsharedStage(MegatronCoreGPTStage):
    def __init__(self, *args):
        super().__init__(*args)
        self.share_embeddings_and_output_weights = False  # the bug: finalize sees no tie


@mutant("mcore-gpt-pp-tied-grads-not-summed", base="baseline.megatron.gpt-ptdp",
        overrides={"model": "tiny-4l", "pp": "2", "dp": "1", "ep": "1", "etp": "0",
                   "num_experts": "0", "schedule": "1f1b", "steps": "2",
                   "tie_embeddings": "true"},
        bug="the stage wrapper hides the tie from finalize_model_grads: the first stage's "
            "embedding and the last stage's head copy step on their own gradients")
class MCoreGPTPPTiedNotSummed(MegatronCoreGPTPTDP):
    def build_stage(self, config, stage):
        tied = self.ctx.model.tie_embeddings and self.pp > 1
        if tied:
            adopt_embedding_group(self.ctx.mesh)
        no_cuda_rng_fork()
        with _CudaMovesOnCpu() if tied else nullcontext():
            return _UnsharedStage(self.ctx.model, self.ctx.run.seed, self.group, self.tp,
                                  self.tp_rank, stage, config)


class _UnmarkedNorm(SequenceParallelTorchNorm):
    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **unused):
        norm = SequenceParallelTorchNorm.__new__(cls, config, hidden_size, eps)
        for p in norm.parameters():
            p.sequence_parallel = False  # the bug: finalize_model_grads leaves them partial
        return norm


class _UnmarkedNormStage(MegatronCoreGPTStage):
    def layer_spec(self, conf):
        return sequence_parallel_spec(conf, _UnmarkedNorm)


@mutant("mcore-gpt-sp-norm-grads-not-reduced", base="baseline.megatron.gpt-ptdp",
        overrides={**LLAMA, "num_layers": "4", "tp": "2", "pp": "2", "dp": "1", "ep": "1",
                   "etp": "0", "num_experts": "0", "schedule": "1f1b", "steps": "2",
                   "sp": "true"},
        bug="sequence parallelism with norms not marked sequence_parallel: their gradients "
            "stay each rank's sequence shard's part (finalize_model_grads skips them)")
class MCoreGPTSPNormNotReduced(MegatronCoreGPTPTDP):
    stage_cls = _UnmarkedNormStage


#: a cp = 2 case of the PTD-P GPTModel on the LLaMA blocks (RoPE), no pipeline
CP_CASE = {**LLAMA, "cp": "2", "tp": "1", "pp": "1", "dp": "1", "ep": "1", "etp": "0",
           "num_experts": "0", "schedule": "1f1b", "steps": "2"}


class _LocalRopeStage(MegatronCoreGPTStage):
    def adapt(self) -> None:
        rope, cp = self.gpt.rotary_pos_emb, self.gpt.config.context_parallel_size

        def local(max_seq_len, offset=0, packed_seq=False, cp_group=None):
            return rope.get_emb(max_seq_len // cp, offset)  # the bug: chunk-local positions

        rope.forward = local


@mutant("mcore-gpt-cp-rope-local-positions", base="baseline.megatron.gpt-ptdp",
        overrides=CP_CASE,
        bug="context parallelism with RoPE at each rank's local positions 0..s/cp-1, not the "
            "global positions of its zig-zag chunks (get_pos_emb_on_this_cp_rank bypassed)")
class MCoreGPTCPRopeLocal(MegatronCoreGPTPTDP):
    stage_cls = _LocalRopeStage


class _RankMeanStage(MegatronCoreGPTStage):
    loss_over_cp = staticmethod(lambda losses, group: losses.mean())  # the bug: no cp sum


@mutant("mcore-gpt-cp-loss-rank-mean", base="baseline.megatron.gpt-ptdp",
        overrides=CP_CASE,
        bug="context parallelism with each cp rank's own token mean as the micro-batch's "
            "loss (not all-reduced over cp): cp times the gradient after the schedule's "
            "scaling and DDP's dp x cp average")
class MCoreGPTCPLossRankMean(MegatronCoreGPTPTDP):
    stage_cls = _RankMeanStage


@mutant("mcore-gpt-cp-grads-over-dp-only", base="baseline.megatron.gpt-ptdp",
        overrides=CP_CASE,
        bug="context parallelism with the gradients reduced over dp only (DDP's dp_cp group "
            "taken without cp): each cp rank steps on its own tokens' gradient")
class MCoreGPTCPGradsOverDPOnly(MegatronCoreGPTPTDP):
    def build_stage(self, config, stage):
        from megatron.core import parallel_state as ps
        swap_group(ps.get_data_parallel_group(with_context_parallel=True),
                   ps.get_data_parallel_group())  # the bug: the group DDP reduces over
        return super().build_stage(config, stage)
