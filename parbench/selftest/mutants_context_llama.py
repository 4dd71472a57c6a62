"""RoPE and packed documents under context parallelism (issues 20 and 21): the bugs of a
sequence chunk that forgets where its tokens are.

- RoPE at the chunk's local positions 0..n-1 instead of its tokens' global ones: every rank
  but the first rotates its queries and keys as if its chunk began the sequence (the bug
  context-parallel ports of LLaMA have when they build position ids after the split);
- with the zig-zag layout, RoPE at contiguous positions (rank r's tokens taken as
  r n .. (r+1) n - 1): right for the ring's plain layout, wrong for both halves of a
  load-balanced chunk;
- all-gather CP with packed documents whose gathered keys are masked causally only: the
  positions restart at each EOD but a query attends to the earlier documents of its sample
  (the cumulative sequence lengths not passed to the attention over the gathered sequence).
"""
from __future__ import annotations

import torch

from parbench.model import Documents

from impls.context.schemes import AllGatherScheme, RingAttentionScheme

from .catalogue import mutant

ROPE = {"model": "llama-tiny", "num_kv_heads": "0"}


def _with_positions(docs: Documents, pos: torch.Tensor) -> Documents:
    return Documents(docs.ids, pos.to(docs.pos.device).expand_as(docs.pos))


@mutant("ring-rope-local-positions", base="context.ring-attention", overrides=ROPE,
        bug="RoPE at the chunk's local positions 0..n-1, not its tokens' global ones")
class RingRopeLocalPositions(RingAttentionScheme):
    def set_documents(self, i):
        super().set_documents(i)
        if self.docs is not None:
            self.docs = _with_positions(self.docs, torch.arange(self.docs.pos.shape[1]))


@mutant("ring-zigzag-rope-contiguous", base="context.ring-attention",
        overrides={**ROPE, "cp_balance": "zigzag"},
        bug="zig-zag chunks rotated at contiguous positions r n .. (r+1) n - 1")
class RingZigzagRopeContiguous(RingAttentionScheme):
    def set_documents(self, i):
        super().set_documents(i)
        if self.docs is not None:
            n = self.docs.pos.shape[1]
            self.docs = _with_positions(self.docs, self.cp_rank * n + torch.arange(n))


@mutant("allgather-packed-causal-only", base="context.allgather",
        overrides={"pack_docs": "3", "num_microbatches": "2"},
        bug="packed documents: the gathered keys masked causally only (attention crosses "
            "documents; positions restarted)")
class AllGatherPackedCausalOnly(AllGatherScheme):
    def set_documents(self, i):
        super().set_documents(i)
        self.core.g.docs = None
