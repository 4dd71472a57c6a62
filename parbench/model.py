"""The reference GPT decoder, its deterministic initialisation and synthetic data.

Pre-LN blocks (Radford et al. 2019): LN -> causal multi-head attention -> residual,
LN -> MLP(h -> f -> h, GELU) -> residual; learned token and position embeddings; final LN
and an LM head (untied by default). Parameter count per layer is 12h^2 + 13h for f = 4h
(Narayanan et al. 2021, Sec. 5.1). With ``num_experts > 0`` every ``moe_every``-th MLP is a
mixture of experts (``parbench.moe``: router, capacity, dropping, auxiliary losses).

Every parameter is initialised from its own generator seeded by (seed, full name), so any
partition of the model (a pipeline stage, a shard) rebuilds exactly the same full weights
without materialising the rest. Parameter names are the same in every scheme:
``embed.tok.weight``, ``embed.pos.weight``, ``blocks.{i}.attn.qkv.weight``, ...,
``head.ln.weight``, ``head.out.weight``.
"""
from __future__ import annotations

import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import ModelConfig


def param_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


def init_parameters(module: nn.Module, seed: int, std: float, prefix: str = "") -> None:
    """Normal(0, std) for weights of linears/embeddings, zeros for biases, ones for LN."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            full = prefix + name
            if full.endswith("ln1.weight") or full.endswith("ln2.weight") or \
                    full.endswith("ln.weight"):
                p.fill_(1.0)
            elif full.endswith(".bias"):
                p.zero_()
            else:
                g = torch.Generator().manual_seed(param_seed(seed, full))
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32) * std)


class Embedding(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.pos = nn.Embedding(cfg.seq_length, cfg.hidden_size) if cfg.position_embeddings \
            else None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens)
        if self.pos is not None:
            x = x + self.pos.weight[: tokens.shape[1]]
        return x


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.num_heads, h // self.num_heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, h))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.ffn)
        self.fc2 = nn.Linear(cfg.ffn, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """A pre-LN layer; layer ``index`` is an MoE layer when ``moe.is_moe_layer`` says so."""

    def __init__(self, cfg: ModelConfig, index: int = 0, routing=None):
        super().__init__()
        from .moe import MoE, is_moe_layer
        self.ln1 = nn.LayerNorm(cfg.hidden_size)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden_size)
        self.mlp = MoE(cfg, routing) if is_moe_layer(cfg, index) else MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    """Final LN + LM head + mean token cross-entropy."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln = nn.LayerNorm(cfg.hidden_size)
        self.out = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.out(self.ln(x))
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                               targets.reshape(-1))


class GPTStage(nn.Module):
    """A contiguous slice of the GPT: optional embedding, layers [lo, hi), optional head.

    With ``first`` and ``last`` and all layers it is the whole model. Block ``i`` keeps its
    global name ``blocks.{i}`` so parameter names match the full model.
    """

    def __init__(self, cfg: ModelConfig, lo: int = 0, hi: int | None = None,
                 first: bool = True, last: bool = True, seed: int = 0, routing=None):
        super().__init__()
        hi = cfg.num_layers if hi is None else hi
        self.cfg, self.lo, self.hi, self.first, self.last = cfg, lo, hi, first, last
        self.embed = Embedding(cfg) if first else None
        self.blocks = nn.ModuleDict({str(i): Block(cfg, i, routing) for i in range(lo, hi)})
        self.head = Head(cfg) if last else None
        init_parameters(self, seed, cfg.init_std)
        if cfg.tie_embeddings and first and last:
            self.head.out.weight = self.embed.tok.weight

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (first stage) or hidden states in; hidden states or the loss (last) out."""
        if self.embed is not None:
            x = self.embed(x)
        for blk in self.blocks.values():
            x = blk(x)
        if self.head is not None:
            return self.head(x, targets)
        return x


def build_model(cfg: ModelConfig, seed: int, routing=None) -> GPTStage:
    """The whole reference model (``routing``: the MoE routing groups, ``parbench.moe``)."""
    return GPTStage(cfg, seed=seed, routing=routing)


def stage_layers(num_layers: int, num_stages: int, stage: int) -> tuple[int, int]:
    """Even split of layers over stages: layers [lo, hi) of ``stage``."""
    if num_layers % num_stages:
        raise ValueError(f"num_stages={num_stages} does not divide num_layers={num_layers}")
    per = num_layers // num_stages
    return stage * per, (stage + 1) * per


def build_stage(cfg: ModelConfig, seed: int, stage: int, num_stages: int) -> GPTStage:
    lo, hi = stage_layers(cfg.num_layers, num_stages, stage)
    return GPTStage(cfg, lo, hi, first=stage == 0, last=stage == num_stages - 1, seed=seed)


def synthetic_batch(cfg: ModelConfig, batch_size: int, seed: int, step: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic random tokens for one global batch: (inputs, targets), each [B, s]."""
    g = torch.Generator().manual_seed(seed * 7919 + step * 104_729 + 17)
    tokens = torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_length + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def make_optimizer(params, run_cfg) -> torch.optim.Optimizer:
    """The optimizer every scheme and the golden run use (single-tensor, not foreach, so the
    arithmetic is elementwise-identical on a flat shard and on the full tensors)."""
    params = list(params)
    if run_cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=run_cfg.lr, weight_decay=run_cfg.weight_decay,
                               foreach=False)
    return torch.optim.AdamW(params, lr=run_cfg.lr, betas=(run_cfg.beta1, run_cfg.beta2),
                             eps=run_cfg.eps, weight_decay=run_cfg.weight_decay,
                             foreach=False)


def compute_dtype(run_cfg) -> torch.dtype:
    return torch.bfloat16 if run_cfg.dtype == "bf16" else torch.float32
