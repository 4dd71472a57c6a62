"""The hybrid's training features (issue 20, sec. 3) broken as trainers have broken them when
composing them with tensor, context and pipeline parallelism (see mutants_hybrid for the
hybrid's reductions):

- a masked loss: each micro-batch's mean over its own counted tokens, times 1/m (the
  gradient-accumulation normalisation bug Megatron-LM's --calculate-per-token-loss exists
  for), instead of the counted tokens' sum over the global count;
- packed documents: the later pipeline stages, which receive hidden states, attend plain
  causally (the documents not handed to the stages that do not load the batch); all-gather
  CP's gathered keys masked causally only (the documents not bound to the core); the learned
  positions of a cp shard counted from the sample's start (--reset-attention-mask without
  --reset-position-ids);
- tied embeddings across stages: the first stage's embedding and the last stage's copy each
  stepping on its own gradient (the embedding group's all-reduce left out).

They run on the hybrid family's case (``FAMILY_CASES['hybrid']``: tp 2) made dense, with
tied embeddings, a masked loss and packed documents, on tp 2 x pp 2 (1F1B) or tp 2 x cp 2
(all-gather CP).
"""
from __future__ import annotations

import torch

from parbench.model import Documents, counted_tokens

from impls.hybrid.executor import HybridExecutor
from impls.hybrid.model import HybridGatherCore, HybridStage
from impls.hybrid.scheme import HybridScheme

from .catalogue import mutant

#: dense tp 2 x pp 2, tied, packed, 60% prompts over 2 micro-batches: counts differ per
#: micro-batch and every step holds samples of 2 or 3 documents
PIPE = {"model": "tiny-4l", "pp": "2", "dp": "1", "ep": "1", "num_experts": "0",
        "tie_embeddings": "true", "loss_mask": "0.6", "pack_docs": "3",
        "num_microbatches": "2"}
#: dense tp 2 x cp 2 with all-gather CP (contiguous shards), packed
CP = {"model": "tiny", "cp": "2", "dp": "1", "ep": "1", "num_experts": "0",
      "cp_algorithm": "allgather", "cp_balance": "none", "pack_docs": "3",
      "num_microbatches": "2"}


class _MeanPerMicrobatch(HybridExecutor):
    def loss_scale(self, mb, y):
        if self.global_tokens is None:
            return super().loss_scale(mb, y)
        return 1.0 / (self.m * counted_tokens(y))  # the bug: the micro-batches' means averaged


@mutant("hybrid-loss-mean-per-microbatch", base="hybrid", overrides=PIPE,
        bug="each micro-batch's loss the mean over its own counted tokens scaled by 1/m, not "
            "the counted tokens' sum over the global batch's count")
class HybridLossMeanPerMicrobatch(HybridScheme):
    executor_class = _MeanPerMicrobatch


class _DocsOnFirstStageOnly(HybridExecutor):
    def documents(self, slot, tokens):
        docs = super().documents(slot, tokens)
        if docs is None or slot.module.first:
            return docs
        b, s = tokens.shape  # the bug: one document per sample on the later stages
        pos = torch.arange(s, device=tokens.device).expand(b, s)
        return Documents(torch.zeros_like(tokens), pos)


@mutant("hybrid-packed-docs-first-stage-only", base="hybrid", overrides=PIPE,
        bug="only the first pipeline stage attends within the packed documents; the later "
            "stages, handed no documents, attend plain causally")
class HybridPackedDocsFirstStageOnly(HybridScheme):
    executor_class = _DocsOnFirstStageOnly


@mutant("hybrid-tied-grads-not-synced", base="hybrid", overrides=PIPE,
        bug="the tied embedding's first- and last-stage copies step on their own gradients: "
            "the embedding group's all-reduce left out")
class HybridTiedGradsNotSynced(HybridScheme):
    def sync_tied(self):
        pass  # the bug: no all-reduce over the embedding group


class _GatherCausalOnly(HybridGatherCore):
    def __call__(self, q, k, v, docs=None):
        return super().__call__(q, k, v)  # the bug: the documents never reach the mask


@mutant("hybrid-cp-gather-crosses-docs", base="hybrid", overrides=CP,
        bug="all-gather CP masks the gathered keys causally only: a query attends to the "
            "earlier documents of its sample")
class HybridCPGatherCrossesDocs(HybridScheme):
    def __init__(self, ctx):
        super().__init__(ctx)
        for slot in self.slots.values():
            slot.module.core.__class__ = _GatherCausalOnly


class _SamplePositions(HybridStage):
    def embed(self, tokens, docs=None):
        return super().embed(tokens, None)  # the bug: the shard's positions in the sample


@mutant("hybrid-cp-packed-positions-not-reset", base="hybrid", overrides=CP,
        bug="attention within documents, but a cp shard's learned positions are its "
            "positions in the sample, not within its documents")
class HybridCPPackedPositionsNotReset(HybridScheme):
    stage_class = _SamplePositions
