"""Packed documents between the blocks of a ring (``pack_docs``; issue 20, sec. 3).

With packed sequences a query may attend to a key iff the key is not later in the sequence
*and* in the same document (Megatron-LM's --reset-attention-mask;
``parbench.model.packing.allowed``). A ring core computes one (query block, key block) pair
at a time, each block a ring rank's tokens in increasing global position
(``layout.positions``), so the pair's mask is ``allowed`` on the two blocks' global
positions and the micro-batch's document ids there -- every rank holds the whole
micro-batch's ids (it holds the whole samples' tokens), so no message is added and the bytes
stay the closed form's.

A block in which some query row has no allowed key contributes nothing to that row
(``kernels``: its output 0, its log-sum-exp -inf); every row has at least its own token in
its own (diagonal) block, so the merged result is always defined.
"""
from __future__ import annotations

import torch

from parbench.model.packing import Documents, allowed

from .layout import positions

Slice = tuple[int, int | None]
#: a whole block's rows
WHOLE: Slice = (0, None)


class DocumentMasks:
    """The masks of query ring rank ``rank``'s rows against every ring rank's block, for the
    micro-batch's documents ``docs`` (ids over the whole sequence, [b, s]); ``where(r)``
    gives ring rank r's global positions."""

    def __init__(self, docs: Documents, rank: int, where):
        self.ids, self.rank, self.where = docs.ids, rank, where
        self._cols: dict[int, torch.Tensor] = {}

    def cols(self, r: int) -> torch.Tensor:
        """Ring rank ``r``'s global positions, on the ids' device."""
        if r not in self._cols:
            self._cols[r] = self.where(r).to(self.ids.device)
        return self._cols[r]

    def at(self, src: int, qs: Slice, ks: Slice, query_rank: int | None = None
           ) -> torch.Tensor | None:
        """(b, 1, nq, nk) "may attend" of rows ``qs`` of the query rank's block (this rank's,
        or ``query_rank``'s) against rows ``ks`` of ring rank ``src``'s block."""
        q = self.cols(self.rank if query_rank is None else query_rank)[qs[0]:qs[1]]
        k = self.cols(src)[ks[0]:ks[1]]
        return allowed(self.ids[:, q], self.ids[:, k], q, k)


def ring_masks(docs: Documents | None, rank: int, size: int, n: int, balance: str
               ) -> DocumentMasks | None:
    """The masks of a ring of ``size`` ranks of ``n`` tokens each under layout ``balance``
    (None: not packed)."""
    if docs is None:
        return None
    return DocumentMasks(docs, rank, lambda r: positions(n * size, size, r, balance))


def mask_at(masks: DocumentMasks | None, src: int, qs: Slice, ks: Slice,
            query_rank: int | None = None) -> torch.Tensor | None:
    """``masks.at(...)``, or None when not packed (the kernel's causal flag decides)."""
    return None if masks is None else masks.at(src, qs, ks, query_rank)


def kernel_args(causal: bool, mask: torch.Tensor | None) -> dict:
    """The kernels' keywords of one block: the document mask (which holds the causal rule
    on global positions) or the block plan's causal flag."""
    return {"causal": causal} if mask is None else {"causal": False, "mask": mask}
