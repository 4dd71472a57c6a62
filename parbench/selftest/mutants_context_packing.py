"""Packed sequences (``pack_docs``; issue 20, sec. 3) handled wrongly by the ring-based
context-parallel schemes: the bugs of a document mask that a sequence shard gets half right.

- a ring that masks documents on its own (diagonal) block only: the K/V blocks of the other
  ranks are masked causally, so a query attends to the end of the previous document when it
  sits on another rank (the cumulative sequence lengths applied to the local chunk only);
- Ulysses with each rank's document ids counted from the start of its own shard (the ids a
  rank finds in its tokens) and gathered as they are: a document that spans a shard boundary
  is cut in two, documents of different shards share an id;
- a ring whose blocks trust the fused kernel's log-sum-exp of a row with no allowed key (ATen's
  CPU flash kernel reports 0 there, not -inf): the empty block weighs in the online-softmax
  merge as one key of score 0 and value 0, shrinking the row.
"""
from __future__ import annotations

import math

import torch

from parbench.model import Documents

from impls.context.documents import DocumentMasks
from impls.context.layout import positions
from impls.context.ring import RingPeers
from impls.context.schemes import RingAttentionScheme, UlyssesScheme

from .catalogue import mutant

PACKED = {"pack_docs": "3", "num_microbatches": "2"}


class _DiagonalOnlyMasks(DocumentMasks):
    def at(self, src, qs, ks, query_rank=None):
        if src != self.rank:
            return None  # the bug: other ranks' blocks get the plan's causal flag only
        return super().at(src, qs, ks, query_rank)


class _DiagonalDocumentsPeers(RingPeers):
    def masks(self, n):
        if self.docs is None:
            return None
        size, balance = self.size, self.balance
        return _DiagonalOnlyMasks(self.docs, self.rank,
                                  lambda r: positions(n * size, size, r, balance))


@mutant("ring-packed-offdiag-causal", base="context.ring-attention",
        overrides={**PACKED, "cp_balance": "zigzag"},
        bug="packed documents masked on the rank's own block only; the other ranks' K/V "
            "blocks causal only (attention crosses documents across shards)")
class RingPackedOffDiagonalCausal(RingAttentionScheme):
    peers_class = _DiagonalDocumentsPeers


@mutant("ulysses-packed-shard-doc-ids", base="context.ulysses", overrides=PACKED,
        bug="document ids counted from each rank's own shard and gathered without the "
            "offset of the EODs before it")
class UlyssesPackedShardDocIds(UlyssesScheme):
    def bind_documents(self, docs):
        if docs is not None:
            n = self.ctx.model.seq_length // self.cp
            ids = docs.ids.clone()
            for r in range(self.cp):
                shard = ids[:, r * n:(r + 1) * n]
                shard -= shard[:, :1].clone()  # the bug: this shard's first id taken as 0
            docs = Documents(ids, docs.pos)
        super().bind_documents(docs)


class _KernelLsePeers(RingPeers):
    def attend(self, q, k, v, causal, mask=None):
        if mask is None:
            return super().attend(q, k, v, causal, mask)
        add = torch.zeros(mask.shape, dtype=q.dtype).masked_fill_(~mask, float("-inf"))
        # the bug: the fused kernel called directly; its lse of an empty row (0) is kept
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=add, scale=1.0 / math.sqrt(q.shape[-1]))


@mutant("ring-packed-empty-block-lse", base="context.ring-attention",
        overrides={**PACKED, "cp_balance": "none"},
        bug="a block row with no allowed key keeps the kernel's log-sum-exp 0 instead of "
            "-inf, and leaks into the online-softmax merge")
class RingPackedEmptyBlockLse(RingAttentionScheme):
    peers_class = _KernelLsePeers
