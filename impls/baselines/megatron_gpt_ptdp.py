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
wire bytes and calls = the closed form. Not run: ``clip_grad`` (refused: Megatron's norm skips the
loaded weights, ``baseline.megatron.ptdp``'s finding), tied embeddings across stages
(its ``setup_embeddings_and_output_layer`` moves the copy with ``.cuda()``: no shim yet);
sequence and context parallelism, which the local spec refuses (``WrappedTorchNorm``,
``DotProductAttention`` assert them unsupported without TransformerEngine).

Optional: ``pip install -e ".[megatron]"``; isolated, as every Megatron-Core baseline.
"""
from __future__ import annotations

import dataclasses

import torch

from parbench.config import MODEL_FEATURES, CaseConfig, ConfigError
from parbench.scheme import register

from impls.baselines.megatron_gpt import (MegatronCoreGPTModel, mcore_name, no_cuda_rng_fork,
                                          transformer_config)
from impls.baselines.megatron_ptdp import MegatronCorePTDP


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
        self.config, self.model_type = config, ModelType.encoder_or_decoder
        self.pre_process, self.post_process = self.first, self.last
        self.share_embeddings_and_output_weights = False

    def build_config(self, cfg, tp, sp):
        return self._config

    def gpt_kwargs(self) -> dict:
        return {"pre_process": self.first, "post_process": self.last}

    def mcore_name(self, ref: str) -> str | None:
        if ref.startswith("blocks."):
            i = int(ref.split(".")[1])
            if not self.lo <= i < self.hi:
                return None  # another stage's layer
            return mcore_name(ref.replace(f"blocks.{i}.", f"blocks.{i - self.lo}.", 1))
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
        if self.last:
            return super().forward(tokens, targets)
        b, s = tokens.shape
        pos = torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s)
        causal = torch.triu(torch.ones(s, s, dtype=torch.bool, device=tokens.device), 1)
        return self.gpt(tokens, pos, causal[None, None])  # [s, b, h] to the next stage


@register
class MegatronCoreGPTPTDP(MegatronCorePTDP):
    name = "baseline.megatron.gpt-ptdp"
    description = ("Megatron-Core 0.16 GPTModel (local spec) per pipeline stage: 1F1B "
                   "schedule, its DDP, tensor-parallel layers")
    #: the LLaMA blocks, in Megatron's own layers
    model_features = MODEL_FEATURES

    @classmethod
    def check(cls, case: CaseConfig) -> None:
        super().check(case)
        m, t = case.model, case.layout.tp
        g = m.num_kv_heads or m.num_heads
        if g % t and t % g:
            raise ConfigError(f"tp={t}: Megatron-Core needs num_kv_heads={g} to be a "
                              "multiple or a divisor of tp")
        if case.run.clip_grad:
            raise ConfigError(f"clip_grad={case.run.clip_grad:g} is not run by {cls.name}: "
                              "Megatron-Core 0.16.1 counts loaded (not initialised) tp weights "
                              "as duplicates in its norm (the finding of "
                              "baseline.megatron.ptdp); set clip_grad=0")

    def transformer_config(self, cfg, par):
        base = transformer_config(cfg, par.tp, False)
        return dataclasses.replace(
            base, pipeline_model_parallel_size=par.pp, pipeline_dtype=torch.float32,
            deallocate_pipeline_outputs=True, batch_p2p_comm=True, batch_p2p_sync=False)

    def build_stage(self, config, stage):
        no_cuda_rng_fork()
        return MegatronCoreGPTStage(self.ctx.model, self.ctx.run.seed, self.group, self.tp,
                                    self.tp_rank, stage, config)
