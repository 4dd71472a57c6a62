"""Megatron-Core 0.16's whole ``GPTModel`` (``megatron.core.models.gpt``, the local layer spec
``get_gpt_layer_local_spec``: no TransformerEngine / Apex) as a framework under test,
against ``tensor.megatron`` (issue 21). Sequence parallelism is not run: the local spec's
norm (``WrappedTorchNorm``) asserts "sequence parallel not supported by torch LayerNorm"
(SP needs TransformerEngine's or Apex's norms, absent on this CPU machine), so this tp-only
scheme has no ``-sp`` variant; ``baseline.megatron.gpt-ptdp`` runs SP with its DDP's
``finalize_model_grads`` and shim 5 (:class:`SequenceParallelTorchNorm`).

The model is built from the case's model config as a ``TransformerConfig`` (Megatron-Core
docs, "transformer_config"): num_query_groups for GQA, ``gated_linear_unit`` with SiLU for
SwiGLU, ``normalization`` RMSNorm / LayerNorm, ``add_bias_linear``, ``position_embedding_type``
rope (``rotary_base`` = rope_theta; Megatron's rotary is the non-interleaved rotate-half one,
as the reference's ``blocks.rotate``) or learned_absolute, the tied head, tp from the
layout, CPU initialisation in fp32, no dropout and no fused kernels.

Weights: the reference model's, mapped by name (:func:`mcore_name`); Megatron-Core's
``linear_qkv`` rows are group-interleaved [q of group 0, k0, v0, q of group 1, ...] and split
in t equal row blocks (``impls.tensor.gqa.qkv_rows``, written from Megatron-Core's
attention.py), ``linear_fc1`` holds [gate; up] per tp shard (``MegatronLayout.fc1_rows``).
The loss: Megatron-Core's vocab-parallel logits (``parallel_output``), padded vocabulary rows
masked to -inf (Megatron leaves them in the softmax), ``vocab_parallel_cross_entropy``.
Without sequence parallelism the replicated parameters' gradients agree on every tp rank
with no reduction (``finalize_model_grads`` has nothing to all-reduce at dp = pp = 1).
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from parbench.config import MODEL_FEATURES, CaseConfig, ConfigError
from parbench.model import build_model
from parbench.scheme import register

from impls.baselines.megatron_tp import MegatronCoreBaseline, _set_parallel_state
from impls.tensor import gqa
from impls.tensor.megatron import MegatronFigures
from impls.tensor.megatron_model import MegatronLayout
from impls.tensor.shards import take

#: reference leaf (after ``blocks.i.``) -> Megatron-Core's (after ``decoder.layers.i.``)
LAYER_NAMES = {"ln1": "input_layernorm", "ln2": "pre_mlp_layernorm",
               "attn.qkv": "self_attention.linear_qkv",
               "attn.proj": "self_attention.linear_proj",
               "mlp.fc1": "mlp.linear_fc1", "mlp.fc2": "mlp.linear_fc2"}
TOP_NAMES = {"embed.tok": "embedding.word_embeddings",
             "embed.pos": "embedding.position_embeddings",
             "head.ln": "decoder.final_layernorm", "head.out": "output_layer"}


def mcore_name(ref: str) -> str:
    """Megatron-Core GPTModel's parameter name for the reference model's ``ref``."""
    module, leaf = ref.rsplit(".", 1)
    if module.startswith("blocks."):
        _, i, rest = module.split(".", 2)
        return f"decoder.layers.{i}.{LAYER_NAMES[rest]}.{leaf}"
    return f"{TOP_NAMES[module]}.{leaf}"


class GPTModelLayout(MegatronLayout):
    """Megatron-Core's placement: linear_qkv is t equal blocks of the group-interleaved rows
    whatever t is (t <= g: whole groups per rank, in Megatron's order)."""

    def qkv_rows(self, r: int) -> torch.Tensor:
        return gqa.qkv_rows(self.cfg, self.tp, r)


def transformer_config(cfg, tp: int, sp: bool):
    """The case's model as Megatron-Core's ``TransformerConfig``."""
    from megatron.core.transformer import TransformerConfig
    swiglu = cfg.mlp == "swiglu"
    return TransformerConfig(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_heads,
        num_query_groups=cfg.num_kv_heads or cfg.num_heads, ffn_hidden_size=cfg.ffn,
        gated_linear_unit=swiglu, activation_func=F.silu if swiglu else F.gelu,
        normalization="RMSNorm" if cfg.norm == "rmsnorm" else "LayerNorm",
        layernorm_epsilon=1e-5, add_bias_linear=cfg.bias,
        tensor_model_parallel_size=tp, sequence_parallel=sp,
        use_cpu_initialization=True, perform_initialization=False,
        params_dtype=torch.float32, gradient_accumulation_fusion=False,
        hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False,
        apply_rope_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False)


class SequenceParallelTorchNorm:
    """CPU shim 5, for sequence parallelism: torch's ``LayerNorm`` / ``RMSNorm`` built as
    Megatron-Core's ``WrappedTorchNorm`` builds them (megatron/core/transformer/
    torch_norm.py), with each parameter marked ``sequence_parallel`` as TransformerEngine's
    ``TENorm`` and Apex's ``FusedLayerNorm`` mark theirs, so that ``finalize_model_grads``
    all-reduces their gradients over tp. ``WrappedTorchNorm`` itself asserts sequence
    parallelism off; TransformerEngine and Apex are not installed here. The norm's
    arithmetic is torch's, as without sequence parallelism."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **unused):
        norm_cls = torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm
        norm = norm_cls(normalized_shape=hidden_size, eps=eps)
        norm.returns_residual = False
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel
        return norm


def sequence_parallel_spec(conf, norm=SequenceParallelTorchNorm, **spec_args):
    """The local layer spec (``get_gpt_layer_local_spec(**spec_args)``: e.g. the MoE one)
    with ``norm`` (:class:`SequenceParallelTorchNorm`) as every norm: the layers' (the
    spec's submodules) and the final one (``transformer_block.LayerNormImpl``, which it
    reads when it builds the decoder; this process is isolated)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import transformer_block
    transformer_block.LayerNormImpl = norm
    return with_norm(get_gpt_layer_local_spec(normalization=conf.normalization, **spec_args),
                     norm)


def with_norm(spec, norm):
    """Layer spec ``spec`` with ``norm`` as both of its norms."""
    import dataclasses
    subs = dataclasses.replace(spec.submodules, input_layernorm=norm, pre_mlp_layernorm=norm)
    return dataclasses.replace(spec, submodules=subs)


def check_query_groups(case: CaseConfig) -> None:
    """Megatron-Core splits K/V heads over tp only when one count divides the other."""
    m, t = case.model, case.layout.tp
    g = m.num_kv_heads or m.num_heads
    if g % t and t % g:
        raise ConfigError(f"tp={t}: Megatron-Core needs num_kv_heads={g} to be a multiple or "
                          "a divisor of tp")


def no_cuda_rng_fork() -> None:
    """Megatron-Core's attention enters its CUDA RNG tracker's ``fork`` (the tp-distinct
    dropout stream) even at dropout 0; a CPU process has no CUDA RNG state to add, and with
    no dropout nothing is drawn, so the fork is made a no-op in this (isolated) process."""
    from megatron.core import tensor_parallel
    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker.fork = lambda *args, **kwargs: contextlib.nullcontext()


def process_groups(tp_group, gathers_qkv: bool):
    """Megatron-Core's groups for a tp-only model: tp from the mesh, one-rank cp / pp.

    ``gathers_qkv`` (tp > num_kv_heads): Megatron-Core 0.16.1's attention.py gathers the QKV
    output with ``all_gather_last_dim_from_tensor_parallel_region(mixed_qkv)`` -- no group,
    not the model's ``pg_collection.tp`` -- and ``get_tensor_model_parallel_group_if_none``
    passes None through unless ``parallel_state.is_initialized()`` (a data-parallel group is
    set); the one-rank data-parallel group (dp = 1) makes it fall back to the global tp group,
    the mesh's (set by ``_set_parallel_state``)."""
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection
    me = dist.get_rank()
    singles = [dist.new_group([r]) for r in range(dist.get_world_size())]
    one = singles[me]
    if gathers_qkv:
        ps._DATA_PARALLEL_GROUP = one
    return ProcessGroupCollection(tp=tp_group, cp=one, pp=one, embd=one, pos_embd=one)


class MegatronCoreGPTModel(nn.Module):
    """Megatron-Core's GPTModel holding this rank's shards of the reference weights; forward
    (tokens [b, s], targets [b, s]) -> the mean token loss."""

    #: where each reference parameter's rows go (the self-test's mutants swap it)
    layout_cls = GPTModelLayout

    def __init__(self, cfg, seed: int, group, tp: int, rank: int, sp: bool, pg=None):
        super().__init__()
        from megatron.core.models.gpt import GPTModel
        conf = self.build_config(cfg, tp, sp and tp > 1)
        self.cfg, self.tp, self.layout = cfg, tp, self.layout_cls(cfg, tp)
        self.gpt = GPTModel(
            conf, self.layer_spec(conf), vocab_size=self.layout.vp,
            max_sequence_length=cfg.seq_length,
            share_embeddings_and_output_weights=cfg.tie_embeddings,
            position_embedding_type="rope" if cfg.rope_theta else "learned_absolute",
            rotary_base=cfg.rope_theta or 10000,
            pg_collection=pg or process_groups(group, conf.num_query_groups < tp),
            **self.gpt_kwargs())
        self.adapt()
        self.vocab_start = rank * (self.layout.vp // tp)
        self._load(build_model(cfg, seed), rank)

    # ---- what a variant (the MoE one) changes -------------------------------------------
    def build_config(self, cfg, tp: int, sp: bool):
        return transformer_config(cfg, tp, sp)

    def gpt_kwargs(self) -> dict:
        """More GPTModel arguments (a pipeline stage's pre_process / post_process)."""
        return {}

    def layer_spec(self, conf):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        return get_gpt_layer_local_spec(normalization=conf.normalization)

    def adapt(self) -> None:
        """Changes to the built GPTModel before the weights are loaded (none here)."""

    def mcore_name(self, ref: str) -> str | None:
        """Megatron's name of reference parameter ``ref`` (None: not on this rank)."""
        return mcore_name(ref)

    def _load(self, full: nn.Module, rank: int) -> None:
        """Every Megatron parameter filled from its reference parameter's shard (one left
        unfilled raises: the name mapping missed it)."""
        self._placements, self._params = {}, {}
        mine = dict(self.gpt.named_parameters())
        with torch.no_grad():
            for name, p in full.named_parameters():
                theirs = self.mcore_name(name)
                if theirs is None:
                    continue
                pl = self.layout.placement(name, tuple(p.shape))
                local = p.detach() if pl.replicated else take(p.detach(), pl.index(rank))
                target = mine.pop(theirs)
                target.copy_(local)
                self._placements[name], self._params[name] = pl, target
        if mine:
            raise RuntimeError(f"Megatron-Core parameters with no reference weight: {sorted(mine)}")

    def shards(self):
        return {n: (self._params[n], pl) for n, pl in self._placements.items()}

    def forward(self, tokens, targets):
        b, s = tokens.shape
        pos = torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s)
        return self.token_losses(tokens, targets, pos).mean()

    def token_losses(self, tokens, targets, pos):
        """Each token's loss, [s, b], of ``tokens`` [b, s] at positions ``pos`` (causal
        among them)."""
        from megatron.core import tensor_parallel
        s = tokens.shape[1]
        causal = torch.triu(torch.ones(s, s, dtype=torch.bool, device=tokens.device), 1)
        logits = self.gpt(tokens, pos, causal[None, None])  # [b, s, V'/t]
        valid = self.cfg.vocab_size - self.vocab_start
        if valid < logits.shape[-1]:
            pad = torch.arange(logits.shape[-1], device=logits.device) >= valid
            logits = logits.masked_fill(pad, float("-inf"))
        return tensor_parallel.vocab_parallel_cross_entropy(
            logits.transpose(0, 1).contiguous().float(), targets.t().contiguous())


@register
class MegatronCoreGPTScheme(MegatronCoreBaseline, MegatronFigures):
    name = "baseline.megatron.gpt"
    baseline_of = "tensor.megatron"
    description = "Megatron-Core 0.16 GPTModel (local spec) with the reference weights"
    options = ()
    sp = False
    #: the LLaMA blocks (RoPE, GQA, SwiGLU, RMSNorm, no biases), all in TransformerConfig
    model_features = MODEL_FEATURES
    model_cls = MegatronCoreGPTModel

    @classmethod
    def check(cls, case: CaseConfig) -> None:
        super().check(case)
        check_query_groups(case)

    def build_model(self):
        ctx = self.ctx
        _set_parallel_state(self.group, ctx.device)
        no_cuda_rng_fork()
        return self.model_cls(ctx.model, ctx.run.seed, self.group, self.tp,
                                    self.tp_rank, self.sp).to(ctx.device)

