"""Megatron-Core 0.16's whole ``GPTModel`` under PTD-P (tp x dp x pp) beside ``hybrid`` (issue
21): ``baseline.megatron.gpt-ptdp``.

``baseline.megatron.ptdp``'s machinery unchanged -- ``initialize_model_parallel`` with its
groups checked against the mesh's and swapped for the mesh's handles, the 1F1B schedule
``get_forward_backward_func`` with its ``P2PCommunicator``, its ``DistributedDataParallel``
and ``finalize_model_grads``, the same CPU shims -- but each pipeline stage is Megatron-Core's
own ``GPTModel`` (``megatron_gpt.MegatronCoreGPTModel``: the local layer spec, the case's model
as a ``TransformerConfig``) built with ``pre_process`` on the first stage (the embedding)
and ``post_process`` on the last (final norm, output layer), ``pipeline_model_parallel_size``
in its config: its ``TransformerBlock`` builds the stage's L/p layers and numbers them from
``get_transformer_layer_offset`` (Megatron-Core docs: the layer offset of pp rank r is
r L/p). Reference layer i is the stage's local layer i - r L/p. Its process groups are
``parallel_state``'s (``ProcessGroupCollection.use_mpu_process_groups``: the mesh's handles).
So the LLaMA blocks (RoPE, GQA, SwiGLU, RMSNorm, no biases) run under pipeline parallelism
in Megatron's own attention, MLP and rotary code.

Tied embeddings across the stages (``tie_embeddings`` with pp > 1) run Megatron's own
mechanism: the last stage's ``output_layer.weight`` is a second copy of the word embedding
(loaded with the same shard), ``setup_embeddings_and_output_layer`` all-reduces it over
Megatron's embedding group at build time and ``finalize_model_grads`` sums the two copies'
gradients over it. That group (each pipeline's first and last stage) is checked against the
mesh's ``embd`` subgroup of the same ranks and swapped for its handle, as the other groups
(``adopt_embedding_group``). Shim 4 (CPU only, while the stage is built): ``Tensor.cuda()``
returns the tensor, since the setup moves the copy with ``weight.data.cuda()``. Measured
(tiny-4l, vocabulary 61, tp = pp = 2): equivalent; embd 3,968 B in one all-reduce per rank
and step (the tp rank's 31 x 32 fp32 rows), exactly ``hybrid``'s closed form, as are pp,
tp and the model states; also on llama-tiny with dp = 2.

Traffic: the stage boundary carries the same ``[s, b, h]`` activation as ``hybrid``'s, the
layers Megatron 1D's all-reduces, the dp all-reduce one bucket per stage: ``predict`` is
``hybrid``'s closed form (as ``baseline.megatron.ptdp``'s); a difference is a finding, shown.

Measured (tp = dp = pp = 2, 8 ranks, 3 steps): equivalent on tiny-4l (GPT-2 blocks) and on
llama-tiny; wire bytes and calls per axis equal ``hybrid``'s closed form on every rank and
step (tiny-4l: dp_cp 57,600 B in one all-reduce, pp 8,192 B in 2 sends, tp 74,496 B in 18
all-reduces per rank and step). On the LLaMA blocks the model states hold 16 B more than
the closed form per rank (``other``): Megatron's ``RotaryEmbedding`` keeps its ``inv_freq``
(head_dim / 2 fp32) as a buffer, a difference shown, not a failure. tp = 4 > 2 K/V heads
with pp = 2 (attention.py's QKV all-gather on the global tp group, the mesh's): equivalent,
wire bytes and calls = the closed form. Sequence parallelism (``sp=true``) runs with CPU
shim 5 (``megatron_gpt.SequenceParallelTorchNorm``: the local spec's ``WrappedTorchNorm``
asserts it off without TransformerEngine; the shim builds the same torch norm and marks its
parameters ``sequence_parallel`` as TransformerEngine's norm does): llama-tiny tp = dp =
pp = 2, and tp = pp = 2 with the head tied, equivalent, bytes and calls = ``hybrid``'s
closed form with SP. Not run: ``clip_grad`` (refused: Megatron's norm skips the loaded
weights, ``baseline.megatron.ptdp``'s finding).

Context parallelism (``cp`` > 1, the zig-zag ring): ``DotProductAttention`` asserts it needs
TransformerEngine, so the layer spec's core attention is CPU shim 6
(``megatron_cp.RingCoreAttention``); Megatron's own batch split, RoPE per cp chunk, loss
over cp and DDP over dp x cp run unchanged (``megatron_cp``'s docstring). Measured
(llama-tiny, cp = 2; cp x tp, cp x tp+sp, cp x dp and cp x pp at 2 x 2; tiny at cp = 2):
equivalent; tp, dp_cp and pp bytes and calls = ``hybrid``'s closed form; cp more than the
native p2p ring's (torch's all-gather rotation: four K / V-sized blocks per layer and
micro-batch at cp = 2, the native ring's three; the loss's cp all-reduce), a framework's
difference, shown.

Optional: ``pip install -e ".[megatron]"``; isolated, as every Megatron-Core baseline.
"""
from __future__ import annotations

import dataclasses
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from parbench.config import MODEL_FEATURES, CaseConfig, ConfigError
from parbench.scheme import register

from impls.baselines.megatron_gpt import (MegatronCoreGPTModel, check_query_groups, mcore_name,
                                          no_cuda_rng_fork, sequence_parallel_spec,
                                          transformer_config)
from impls.baselines.megatron_cp import CudaTransfersOnCpu, cp_batch, cp_mean, ring_spec
from impls.baselines.megatron_ptdp import MegatronCorePTDP, swap_group
from impls.pipeline.tied import EMBD_AXIS


class MegatronCoreGPTStage(MegatronCoreGPTModel):
    """Pipeline stage (lo, hi, first, last) of Megatron-Core's GPTModel, as the schedule
    drives it: ``set_input_tensor`` gives the received activation; ``forward(tokens,
    targets)`` returns the stage output (the mean token loss on the last stage)."""

    def __init__(self, cfg, seed, group, tp, rank, stage, config):
        from megatron.core.enums import ModelType
        from megatron.core.process_groups_config import ProcessGroupCollection
        self.lo, self.hi, self.first, self.last = stage
        self._config = config
        pg = ProcessGroupCollection.use_mpu_process_groups(
            required_pgs=["tp", "pp", "cp", "embd", "pos_embd"])
        super().__init__(cfg, seed, group, tp, rank, False, pg=pg)
        self.cp_group = pg.cp
        self.config, self.model_type = config, ModelType.encoder_or_decoder
        self.pre_process, self.post_process = self.first, self.last
        self.share_embeddings_and_output_weights = cfg.tie_embeddings
        self.shared_embedding_or_output_weight = self.gpt.shared_embedding_or_output_weight

    #: the micro-batch's loss from this cp rank's token losses (a self-test mutant swaps it)
    loss_over_cp = staticmethod(cp_mean)

    def build_config(self, cfg, tp, sp):
        return self._config

    def layer_spec(self, conf):
        spec = sequence_parallel_spec(conf) if conf.sequence_parallel else \
            super().layer_spec(conf)
        return ring_spec(spec) if conf.context_parallel_size > 1 else spec  # shim 6

    def gpt_kwargs(self) -> dict:
        return {"pre_process": self.first, "post_process": self.last}

    def mcore_name(self, ref: str) -> str | None:
        if ref.startswith("blocks."):
            i = int(ref.split(".")[1])
            if not self.lo <= i < self.hi:
                return None  # another stage's layer
            return mcore_name(ref.replace(f"blocks.{i}.", f"blocks.{i - self.lo}.", 1))
        if ref == "embed.tok.weight" and self.last and not self.first and self.cfg.tie_embeddings:
            return "output_layer.weight"  # the last stage's copy of the tied weight
        if ref.startswith("embed.") and not self.first:
            return None
        if ref.startswith("head.") and not self.last:
            return None
        return mcore_name(ref)

    def set_input_tensor(self, tensors) -> None:
        self.gpt.set_input_tensor(tensors)

    @property
    def input_tensor(self):
        return self.gpt.decoder.input_tensor

    @input_tensor.setter
    def input_tensor(self, value) -> None:
        self.gpt.decoder.input_tensor = value

    def forward(self, tokens, targets):
        """This cp rank's zig-zag chunks of the micro-batch (Megatron's own split; the whole
        micro-batch at cp = 1) through the stage."""
        tokens, targets, pos = cp_batch(tokens, targets, self.cp_group)
        if self.last:
            return self.loss_over_cp(self.token_losses(tokens, targets, pos), self.cp_group)
        s = tokens.shape[1]
        causal = torch.triu(torch.ones(s, s, dtype=torch.bool, device=tokens.device), 1)
        return self.gpt(tokens, pos, causal[None, None])  # [s/cp, b, h] to the next stage


@register
class MegatronCoreGPTPTDP(MegatronCorePTDP):
    name = "baseline.megatron.gpt-ptdp"
    description = ("Megatron-Core 0.16 GPTModel (local spec) per pipeline stage: 1F1B "
                   "schedule, its DDP, tensor-parallel layers")
    #: the LLaMA blocks, in Megatron's own layers
    model_features = MODEL_FEATURES
    ties_across_stages = True
    #: sequence parallelism (Megatron's own scatter / gather regions, its norms' and row
    #: biases' gradients all-reduced over tp by finalize_model_grads), with shim 5
    options = ("schedule", "sp", "cp_algorithm", "cp_balance")
    uses = ("tp", "cp", "dp", "pp")
    #: shims 2 and 7 (``megatron_cp``): RoPE's cp chunk index is pinned and moved to CUDA
    cpu_mode = CudaTransfersOnCpu
    #: the stage (a self-test mutant replaces it)
    stage_cls = MegatronCoreGPTStage

    @classmethod
    def check(cls, case: CaseConfig) -> None:
        super().check(case)
        check_query_groups(case)
        m, t = case.model, case.layout.tp
        sp = case.options.tensor.sp and t > 1
        if sp and m.seq_length % t:
            raise ConfigError(f"tp={t} must divide seq_length={m.seq_length} (sequence "
                              "parallelism)")
        check_context_parallel(case)
        if case.run.clip_grad:
            raise ConfigError(f"clip_grad={case.run.clip_grad:g} is not run by {cls.name}: "
                              "Megatron-Core 0.16.1 counts loaded (not initialised) tp weights "
                              "as duplicates in its norm (the finding of "
                              "baseline.megatron.ptdp); set clip_grad=0")

    def transformer_config(self, cfg, par):
        base = transformer_config(cfg, par.tp, self.ctx.options.tensor.sp and par.tp > 1)
        return dataclasses.replace(
            base, pipeline_model_parallel_size=par.pp, pipeline_dtype=torch.float32,
            context_parallel_size=par.cp, cp_comm_type="p2p",
            deallocate_pipeline_outputs=True, batch_p2p_comm=True, batch_p2p_sync=False)

    def build_stage(self, config, stage):
        no_cuda_rng_fork()
        tied = self.ctx.model.tie_embeddings and self.pp > 1
        if tied:
            adopt_embedding_group(self.ctx.mesh)
        with _CudaMovesOnCpu() if tied and not torch.cuda.is_available() else nullcontext():
            return self.stage_cls(self.ctx.model, self.ctx.run.seed, self.group, self.tp,
                                  self.tp_rank, stage, config)


def check_context_parallel(case: CaseConfig) -> None:
    """cp > 1: TransformerEngine's p2p ring with its causal zig-zag balancing (shim 6), on
    2 cp chunks of the sequence; with sequence parallelism each rank's s/cp tokens split
    over tp."""
    c, opt, s, t = case.layout.cp, case.options.context, case.model.seq_length, case.layout.tp
    if c == 1:
        return
    if opt.cp_algorithm != "ring-attention" or opt.cp_balance != "zigzag":
        raise ConfigError(f"cp_algorithm={opt.cp_algorithm}, cp_balance={opt.cp_balance}: "
                          "Megatron-Core's context parallelism is the zig-zag ring "
                          "(cp_algorithm=ring-attention, cp_balance=zigzag)")
    if s % (2 * c):
        raise ConfigError(f"seq_length={s}: Megatron-Core splits it into 2 cp = {2 * c} "
                          "chunks (get_batch_on_this_cp_rank); it must divide")
    if case.options.tensor.sp and t > 1 and (s // c) % t:
        raise ConfigError(f"seq_length={s}: with sp=true tp={t} must divide the rank's "
                          f"s/cp = {s // c} tokens")


class _CudaMovesOnCpu(TorchFunctionMode):
    """Shim 4: ``Tensor.cuda()`` is the tensor itself. Megatron-Core's
    ``setup_embeddings_and_output_layer`` moves the tied copy with ``weight.data.cuda()``
    before all-reducing it over the embedding group."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.cuda:
            return args[0]
        return func(*args, **(kwargs or {}))


def adopt_embedding_group(mesh) -> None:
    """Megatron's embedding group (each pipeline's first and last stage), checked against
    the mesh's ``embd`` subgroup of the same ranks and swapped for its handle (module
    docstring: its all-reduce is then recorded on axis ``embd``, as ``hybrid``'s)."""
    from megatron.core import parallel_state as ps
    parts = [[ranks[0], ranks[-1]] for ranks in mesh.layout.groups("pp")]
    taken = {r for part in parts for r in part}
    world = mesh.layout.world_size
    mine = mesh.subgroup(EMBD_AXIS, parts + [[r] for r in range(world) if r not in taken])
    theirs = ps.get_embedding_group()
    members = dist.get_process_group_ranks(theirs)
    if members != mesh.subgroup_ranks(EMBD_AXIS):
        raise RuntimeError(f"rank {mesh.rank}: Megatron-Core's embedding group holds ranks "
                           f"{members}, the mesh's {mesh.subgroup_ranks(EMBD_AXIS)}")
    swap_group(theirs, mine)
