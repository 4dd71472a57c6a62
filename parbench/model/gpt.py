"""The reference GPT decoder assembled: pre-LN layers (Radford et al. 2019): LN -> causal
multi-head attention -> residual, LN -> MLP -> residual; embeddings first, final LN and an LM
head (untied by default) last. With ``num_experts > 0`` every ``moe_every``-th MLP is a
mixture of experts (``parbench.model.moe``).

Parameter names are the same in every scheme: ``embed.tok.weight``, ``embed.pos.weight``,
``blocks.{i}.attn.qkv.weight``, ..., ``head.ln.weight``, ``head.out.weight``.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn

from ..config import ModelConfig
from ..layout import chunk_range
from .blocks import MLP, Attention, Embedding, Head, make_norm
from .init import init_parameters
from .mla import LatentAttention
from .moe import MoE, RoutingGroups, is_moe_layer
from .packing import Documents, documents_of


class Block(nn.Module):
    """A pre-LN layer; layer ``index`` is an MoE layer when ``moe.is_moe_layer`` says so."""

    def __init__(self, cfg: ModelConfig, index: int = 0, routing: RoutingGroups | None = None):
        super().__init__()
        self.ln1 = make_norm(cfg)
        self.attn = LatentAttention(cfg) if cfg.kv_lora_rank else Attention(cfg)
        self.ln2 = make_norm(cfg)
        self.mlp = MoE(cfg, routing) if is_moe_layer(cfg, index) else MLP(cfg)

    def forward(self, x: torch.Tensor, docs: Documents | None = None) -> torch.Tensor:
        # unpacked: one argument, as before (baselines patch attention forwards of one)
        a = self.ln1(x)
        x = x + (self.attn(a) if docs is None else self.attn(a, docs))
        return x + self.mlp(self.ln2(x))


class GPTStage(nn.Module):
    """A contiguous slice of the GPT: optional embedding, layers [lo, hi), optional head.

    With ``first`` and ``last`` and all layers it is the whole model. Block ``i`` keeps its
    global name ``blocks.{i}`` so parameter names match the full model.
    """

    def __init__(self, cfg: ModelConfig, lo: int = 0, hi: int | None = None,
                 first: bool = True, last: bool = True, seed: int = 0,
                 routing: RoutingGroups | None = None):
        super().__init__()
        hi = cfg.num_layers if hi is None else hi
        self.cfg, self.lo, self.hi, self.first, self.last = cfg, lo, hi, first, last
        self.embed = Embedding(cfg) if first else None
        self.blocks = nn.ModuleDict({str(i): Block(cfg, i, routing) for i in range(lo, hi)})
        self.head = Head(cfg) if last else None
        init_parameters(self, seed, cfg.init_std)
        if cfg.tie_embeddings and first and last:
            self.head.out.weight = self.embed.tok.weight

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None,
                docs: Documents | None = None) -> torch.Tensor:
        """tokens (first stage) or hidden states in; hidden states or the loss (last) out.

        A packed model (``cfg.pack_docs``) attends within documents: the first stage finds
        them in its tokens when ``docs`` is not given; a later stage must be given them."""
        docs = self.documents_of(x, docs)
        more = () if docs is None else (docs,)  # unpacked: the modules' one-argument calls
        if self.embed is not None:
            x = self.embed(x, *more)
        for blk in self.blocks.values():
            x = blk(x, *more)
        if self.head is not None:
            return self.head(x, targets)
        return x


    def documents_of(self, x: torch.Tensor, docs: Documents | None) -> Documents | None:
        """The documents this call attends within: ``docs``, or those of the tokens ``x``
        (first stage); None when the model is not packed."""
        if not self.cfg.pack_docs or docs is not None:
            return docs
        if self.embed is None:
            raise ValueError(f"pack_docs={self.cfg.pack_docs}: stage of layers [{self.lo}, "
                             f"{self.hi}) receives hidden states; pass the micro-batch's "
                             "documents (parbench.model.packing.documents of its tokens)")
        return documents_of(self.cfg, x)


def build_model(cfg: ModelConfig, seed: int, routing: RoutingGroups | None = None
                ) -> GPTStage:
    """The whole reference model (``routing``: the MoE routing groups,
    ``parbench.model.moe``)."""
    return GPTStage(cfg, seed=seed, routing=routing)


def stage_layers(num_layers: int, num_stages: int, stage: int,
                 chunks: Sequence[int] | None = None) -> tuple[int, int]:
    """Layers [lo, hi) of ``stage``: an even split of the layers over the stages, or
    ``chunks`` (each stage's layers in the model's order: ``Layout.chunk_layers``)."""
    if chunks is not None:
        return chunk_range(chunks, num_layers, stage)
    if num_layers % num_stages:
        raise ValueError(f"num_stages={num_stages} does not divide num_layers={num_layers}")
    per = num_layers // num_stages
    return stage * per, (stage + 1) * per


def build_stage(cfg: ModelConfig, seed: int, stage: int, num_stages: int,
                chunks: Sequence[int] | None = None) -> GPTStage:
    lo, hi = stage_layers(cfg.num_layers, num_stages, stage, chunks)
    return GPTStage(cfg, lo, hi, first=stage == 0, last=stage == num_stages - 1, seed=seed)
