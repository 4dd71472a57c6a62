"""Packed sequences (``pack_docs``; issue 20, sec. 3) handled wrongly: the bugs trainers have
had when several documents share a sample.

- attention across documents: the positions restart at each EOD but the kernel is plain
  causal, so a token attends to the previous documents of its sample (packing with a
  collator that drops the per-document mask -- cross-contamination, the reason
  flash-attention's varlen kernels and TransformerEngine's THD format take cumulative
  sequence lengths);
- positions not reset: the attention stays within each document but the learned position
  embedding is indexed by the position in the sample (Megatron-LM's --reset-attention-mask
  without --reset-position-ids);
- the boundaries only on the first pipeline stage: the later stages, which receive hidden
  states, attend with a plain causal mask (the packed sequence's lengths are not handed to
  the stages that do not load the batch).
"""
from __future__ import annotations

import torch

from parbench.model import Attention, Documents, Embedding

from impls.data.ddp import NativeDDP
from impls.pipeline import SCHEMES
from impls.pipeline.executor import Executor
from impls.zero.replicated import Zero1

from .catalogue import mutant

#: 1..3 documents per sample over 2 micro-batches: every step of the small case has samples
#: with 2 or 3 documents on each rank
PACKED = {"pack_docs": "3", "num_microbatches": "2"}


class _CausalOnly(Attention):
    def forward(self, x, docs=None):
        return super().forward(x, None)


class _SamplePositions(Embedding):
    def forward(self, tokens, docs=None):
        return super().forward(tokens, None)


@mutant("ddp-packed-attention-crosses-docs", base="data.ddp", overrides=PACKED,
        bug="positions restart at each EOD but attention is plain causal over the sample")
class DDPPackedAttentionCrossesDocs(NativeDDP):
    def __init__(self, ctx):
        super().__init__(ctx)
        for blk in self.model.blocks.values():
            blk.attn.__class__ = _CausalOnly


@mutant("zero1-packed-positions-not-reset", base="zero.1", overrides=PACKED,
        bug="attention within documents but positions counted from the sample's start")
class Zero1PackedPositionsNotReset(Zero1):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.model.embed.__class__ = _SamplePositions


class _FirstStageOnly(Executor):
    def documents(self, slot, tokens):
        docs = super().documents(slot, tokens)
        if slot.module.first:
            return docs
        b, s = tokens.shape  # one document per sample: plain causal
        return Documents(torch.zeros_like(tokens), torch.arange(s, device=tokens.device).expand(b, s))


@mutant("1f1b-packed-docs-first-stage-only", base="pipeline.1f1b", overrides=PACKED,
        bug="only the first stage attends within documents; later stages plain causal")
class OneFOneBPackedDocsFirstStageOnly(SCHEMES["1f1b"]):
    executor_class = _FirstStageOnly
