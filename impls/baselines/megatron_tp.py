"""Megatron-Core 0.16 tensor parallelism (``ColumnParallelLinear``, ``RowParallelLinear``,
``VocabParallelEmbedding``, ``vocab_parallel_cross_entropy``) on the reference GPT,
compared with ``tensor.megatron`` and ``tensor.megatron-sp``.

Megatron-Core's layers take the tensor-parallel group as an argument (``tp_group``), given
here from the mesh; its cross-entropy reads the global ``parallel_state``, which is set to
the same group (Megatron keeps process-global state, so the scheme is ``isolated``: each case
runs in fresh processes). Weights are created on the CPU (``use_cpu_initialization``) and
filled with the reference model's shards (the same head-aligned QKV rows and padded vocabulary
as the native scheme). The model around the layers mirrors Megatron-Core's GPT: sequence-first
activations, ``LanguageModelEmbedding``'s word + position embedding then, with sequence
parallelism, ``scatter_to_sequence_parallel_region``; ``finalize_model_grads``' all-reduce of
the LayerNorm and row-parallel bias gradients (``sequence_parallel`` parameters) in one
coalesced buffer; a tied head passes the embedding weight to the output layer
(``skip_weight_param_allocation``). Padded vocabulary logits are masked to -inf before the
loss (Megatron itself leaves them in the softmax).

Optional: ``pip install -e ".[megatron]"``; without megatron-core the scheme reports itself
unavailable and suites skip it with that reason.
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from parbench.config import CaseConfig, ConfigError
from parbench.model import build_model
from parbench.scheme import register

from impls.tensor.collectives import all_reduce_flat
from impls.tensor.megatron import MegatronFigures
from impls.tensor.megatron_model import MegatronLayout
from impls.tensor.shards import take

# Megatron-Core's fallbacks without TransformerEngine / Apex, announced once per import
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed")
warnings.filterwarnings("ignore", message=".*CUDA_DEVICE_MAX_CONNECTIONS")


def megatron_core_missing() -> str | None:
    """Why Megatron-Core cannot be used here (None: it can)."""
    try:
        import megatron.core  # noqa: F401
        from megatron.core.tensor_parallel import ColumnParallelLinear  # noqa: F401
    except Exception as e:  # ImportError, or a broken install
        return (f"megatron-core is not importable ({type(e).__name__}: {e}); "
                "pip install -e \".[megatron]\"")
    return None


class _DeviceMemoryBuffer:
    """Megatron-Core's ``GlobalMemoryBuffer`` (the sequence-parallel all-gathers' reused
    buffer) on a given device: Megatron's own allocates on the current CUDA device."""

    def __init__(self, device):
        self.device, self.buffer = device, {}

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
        n = 1
        for d in tensor_shape:
            n *= d
        buf = self.buffer.get((name, dtype))
        if buf is None or buf.numel() < n:
            buf = self.buffer[(name, dtype)] = torch.empty(n, dtype=dtype, device=self.device)
        return buf[:n].view(*tensor_shape)


def _set_parallel_state(group, device) -> None:
    """Megatron-Core's global tensor-parallel state, from the mesh's tp group."""
    from megatron.core import parallel_state as ps
    ps._TENSOR_MODEL_PARALLEL_GROUP = group
    ps._TENSOR_MODEL_PARALLEL_GLOBAL_RANKS = dist.get_process_group_ranks(group)
    ps._MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE = dist.get_world_size(group)
    ps._MPU_TENSOR_MODEL_PARALLEL_RANK = dist.get_rank(group)
    ps._GLOBAL_MEMORY_BUFFER = _DeviceMemoryBuffer(device)
    point_current_device_at_cpu(device)


def point_current_device_at_cpu(device) -> None:
    """Megatron-Core allocates on ``torch.cuda.current_device()`` (the sequence-parallel
    mappings, the pipeline's receive buffers, the gradient buffers); on a CPU-only torch that
    raises, so a process that runs only this case (``isolated``) points it at the CPU."""
    if torch.device(device).type == "cpu" and not torch.cuda.is_available():
        torch.cuda.current_device = lambda: "cpu"


class MegatronCoreGPT(nn.Module):
    """The reference GPT on Megatron-Core's tensor-parallel layers, computing in ``[s, b, h]``.

    ``stage`` = (lo, hi, first, last) keeps layers [lo, hi) and the embedding / head when
    first / last (a pipeline stage; default: the whole model); ``conf`` is the Megatron config
    the layers are built with (default: a ``ModelParallelConfig`` for this tp / sp). Megatron's
    global ``parallel_state`` (read by its cross-entropy) is the caller's to set."""

    def __init__(self, cfg, seed: int, group, tp: int, rank: int, sp: bool,
                 stage: tuple | None = None, conf=None):
        super().__init__()
        from megatron.core import ModelParallelConfig
        from megatron.core.tensor_parallel import (ColumnParallelLinear, RowParallelLinear,
                                                   VocabParallelEmbedding)
        self.cfg, self.group, self.tp, self.rank, self.sp = cfg, group, tp, rank, sp and tp > 1
        self.lo, self.hi, self.first, self.last = stage or (0, cfg.num_layers, True, True)
        self.layout = MegatronLayout(cfg, tp)
        if conf is None:
            conf = ModelParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=self.sp,
                                       use_cpu_initialization=True, perform_initialization=False,
                                       params_dtype=torch.float32,
                                       gradient_accumulation_fusion=False)
        h, f, vp = cfg.hidden_size, cfg.ffn, self.layout.vp
        init = nn.init.zeros_
        if self.first:
            self.word = VocabParallelEmbedding(vp, h, init_method=init, config=conf,
                                               tp_group=group)
            self.pos = nn.Embedding(cfg.seq_length, h) if cfg.position_embeddings else None
        self.blocks = nn.ModuleList()
        for _ in range(self.lo, self.hi):
            blk = nn.Module()
            blk.ln1, blk.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
            blk.qkv = ColumnParallelLinear(h, 3 * h, config=conf, init_method=init, bias=True,
                                           gather_output=False, tp_group=group)
            blk.proj = RowParallelLinear(h, h, config=conf, init_method=init, bias=True,
                                         input_is_parallel=True, skip_bias_add=False,
                                         tp_group=group)
            blk.fc1 = ColumnParallelLinear(h, f, config=conf, init_method=init, bias=True,
                                           gather_output=False, tp_group=group)
            blk.fc2 = RowParallelLinear(f, h, config=conf, init_method=init, bias=True,
                                        input_is_parallel=True, skip_bias_add=False,
                                        tp_group=group)
            self.blocks.append(blk)
        self.tied = cfg.tie_embeddings
        if self.last:
            self.final_ln = nn.LayerNorm(h)
            self.out = ColumnParallelLinear(h, vp, config=conf, init_method=init, bias=False,
                                            gather_output=False, tp_group=group,
                                            skip_weight_param_allocation=self.tied)
        self.vocab_start = rank * (vp // tp)
        self._names = self._name_map()
        self._load(build_model(cfg, seed))
        self.layer_probe = None

    def _layers(self):
        """(global layer index, block) of this stage."""
        return zip(range(self.lo, self.hi), self.blocks)

    def _name_map(self) -> dict[str, nn.Parameter]:
        """Reference name -> this model's parameter."""
        out = {}
        if self.first:
            out["embed.tok.weight"] = self.word.weight
            if self.pos is not None:
                out["embed.pos.weight"] = self.pos.weight
        for i, blk in self._layers():
            pre = f"blocks.{i}"
            for ref, mod in (("ln1", blk.ln1), ("ln2", blk.ln2), ("attn.qkv", blk.qkv),
                             ("attn.proj", blk.proj), ("mlp.fc1", blk.fc1),
                             ("mlp.fc2", blk.fc2)):
                out[f"{pre}.{ref}.weight"] = mod.weight
                out[f"{pre}.{ref}.bias"] = mod.bias
        if self.last:
            out["head.ln.weight"], out["head.ln.bias"] = self.final_ln.weight, self.final_ln.bias
            if not self.tied:
                out["head.out.weight"] = self.out.weight
        return out

    def _load(self, full: nn.Module) -> None:
        with torch.no_grad():
            for name, p in full.named_parameters():
                if name not in self._names:
                    continue  # another pipeline stage's
                pl = self.layout.placement(name, tuple(p.shape))
                local = p.detach() if pl.replicated else take(p.detach(), pl.index(self.rank))
                self._names[name].copy_(local)

    def shards(self):
        return {n: (p, self.layout.placement(n, tuple(self._full_shape(n))))
                for n, p in self._names.items()}

    def _full_shape(self, name: str) -> tuple:
        cfg = self.cfg
        h, f, V = cfg.hidden_size, cfg.ffn, cfg.vocab_size
        leaf = ".".join(name.split(".")[-2:])
        return {"tok.weight": (V, h), "pos.weight": (cfg.seq_length, h),
                "qkv.weight": (3 * h, h), "qkv.bias": (3 * h,), "proj.weight": (h, h),
                "proj.bias": (h,), "fc1.weight": (f, h), "fc1.bias": (f,),
                "fc2.weight": (h, f), "fc2.bias": (h,), "out.weight": (V, h)
                }.get(leaf, (h,))

    def sequence_parallel_params(self):
        """Megatron's ``sequence_parallel`` parameters: LayerNorms and row-parallel biases."""
        out = [self.final_ln.weight, self.final_ln.bias] if self.last else []
        for blk in self.blocks:
            out += [blk.ln1.weight, blk.ln1.bias, blk.ln2.weight, blk.ln2.bias,
                    blk.proj.bias, blk.fc2.bias]
        return out

    def attention_core(self, qkv):
        s, b, _ = qkv.shape
        hd = self.cfg.hidden_size // self.cfg.num_heads
        heads = qkv.shape[-1] // (3 * hd)
        q, k, v = qkv.view(s, b, 3, heads, hd).permute(2, 1, 3, 0, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return y.permute(2, 0, 1, 3).reshape(s, b, heads * hd)

    def embed(self, tokens):
        """tokens [b, s] -> hidden [s, b, h] (sp: this rank's sequence shard)."""
        from megatron.core import tensor_parallel
        x = self.word(tokens)  # [b, s, h], all-reduced
        if self.pos is not None:
            x = x + self.pos.weight[: tokens.shape[1]]
        x = x.transpose(0, 1).contiguous()
        if self.sp:
            x = tensor_parallel.scatter_to_sequence_parallel_region(x, group=self.group)
        return x

    def layers(self, x):
        for i, blk in self._layers():
            probe = self.layer_probe(i) if self.layer_probe else None
            if probe is not None:
                probe.__enter__()
            qkv, _ = blk.qkv(blk.ln1(x))
            y, _ = blk.proj(self.attention_core(qkv))
            x = x + y
            u, _ = blk.fc1(blk.ln2(x))
            y, _ = blk.fc2(F.gelu(u))
            x = x + y
            if probe is not None:
                probe.__exit__(None, None, None)
        return x

    def head(self, x, targets):
        """Final LN, vocab-parallel head and Megatron's cross-entropy: the mean token loss."""
        from megatron.core import tensor_parallel
        logits, _ = self.out(self.final_ln(x), weight=self.word.weight if self.tied else None)
        valid = self.cfg.vocab_size - self.vocab_start
        if valid < logits.shape[-1]:
            pad = torch.arange(logits.shape[-1]) >= valid
            logits = logits.masked_fill(pad, float("-inf"))
        loss = tensor_parallel.vocab_parallel_cross_entropy(logits.float(),
                                                            targets.t().contiguous())
        return loss.mean()

    def forward(self, tokens, targets):
        return self.head(self.layers(self.embed(tokens)), targets)


class MegatronCoreBaseline:
    """Mixin (before the Scheme base) of the Megatron-Core baselines: each case runs in fresh
    processes (Megatron keeps process-global state), and without megatron-core the scheme
    reports itself unavailable and its cases are rejected before spawning."""

    isolated = True

    @classmethod
    def unavailable(cls) -> str | None:
        return megatron_core_missing()

    @classmethod
    def check(cls, case: CaseConfig) -> None:
        super().check(case)
        missing = megatron_core_missing()
        if missing:
            raise ConfigError(f"scheme={cls.name}: {missing}")


@register
class MegatronCoreTP(MegatronCoreBaseline, MegatronFigures):
    name = "baseline.megatron.tp"
    baseline_of = "tensor.megatron"
    description = "Megatron-Core 0.16 Column/RowParallelLinear, VocabParallelEmbedding"
    options = ()
    sp = False

    @classmethod
    def check(cls, case: CaseConfig) -> None:
        super().check(case)
        if case.options.recompute != "none":
            raise ConfigError(f"recompute={case.options.recompute} is not used by {cls.name}")
        if cls.sp and case.model.seq_length % case.layout.tp:
            raise ConfigError(f"tp={case.layout.tp} does not divide "
                              f"seq_length={case.model.seq_length}")

    def build_model(self):
        ctx = self.ctx
        _set_parallel_state(self.group, ctx.device)
        return MegatronCoreGPT(ctx.model, ctx.run.seed, self.group, self.tp, self.tp_rank,
                               self.sp).to(ctx.device)

    def after_backward(self) -> None:
        if not self.sp or self.tp == 1:
            return
        all_reduce_flat([p.grad for p in self.model.sequence_parallel_params()], self.group)


@register
class MegatronCoreSP(MegatronCoreTP):
    name = "baseline.megatron.sp"
    baseline_of = "tensor.megatron-sp"
    description = "Megatron-Core 0.16 with sequence_parallel=True"
    sp = True
