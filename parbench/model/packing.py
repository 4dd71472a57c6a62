"""Packed sequences: several documents in one sample, separated by an end-of-document token.

Pre-training and fine-tuning pipelines pack short documents into fixed-length samples; the
model must then neither attend across a document boundary nor carry positions over it.
Megatron-LM does both with ``--reset-attention-mask`` and ``--reset-position-ids``
(``get_ltor_masks_and_position_ids``: after an EOD token at position i, rows > i may not
attend to columns <= i, and positions restart at 0); TransformerEngine's THD format and
flash-attention's varlen kernels express the same mask with cumulative sequence lengths.

With ``ModelConfig.pack_docs = D`` (> 0) each sample holds 1 to D documents: the synthetic
batch (``pack_batch``) puts the EOD token (the last vocabulary id) at the end of every
document but the last, and the model derives its documents from the tokens (``documents``).
The EOD token belongs to the document it ends, as in Megatron.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def eod_token(cfg) -> int:
    """The end-of-document token of a packed model: its last vocabulary id."""
    return cfg.vocab_size - 1


@dataclass(frozen=True)
class Documents:
    """Which document each position of a batch is in, and its position within it.

    ``ids`` and ``pos`` are [b, s] integer tensors (s: the positions this holder sees; a
    context-parallel rank holds its shard's columns, ``take``)."""

    ids: torch.Tensor
    pos: torch.Tensor

    def rows(self, lo: int, hi: int) -> "Documents":
        """Samples [lo, hi) (a data-parallel slice or a micro-batch)."""
        return Documents(self.ids[lo:hi], self.pos[lo:hi])

    def take(self, columns: torch.Tensor) -> "Documents":
        """The sequence positions ``columns`` (a context-parallel shard), in that order."""
        return Documents(self.ids[:, columns], self.pos[:, columns])

    def to(self, device) -> "Documents":
        return Documents(self.ids.to(device), self.pos.to(device))


def documents(tokens: torch.Tensor, eod: int) -> Documents:
    """The documents of a [b, s] batch of input tokens: a document ends at (and includes)
    each EOD token; positions restart after it (Megatron's reset_position_ids)."""
    b, s = tokens.shape
    ends = (tokens == eod).long()
    ids = torch.cumsum(ends, dim=1) - ends  # EODs strictly before each position
    col = torch.arange(s, device=tokens.device).expand(b, s)
    # the first position of each position's document: 0, or one past the latest EOD before
    after_eod = torch.zeros_like(col)
    after_eod[:, 1:] = torch.where(ends[:, :-1].bool(), col[:, 1:], 0)
    start = torch.cummax(after_eod, dim=1).values
    return Documents(ids, col - start)


def documents_of(cfg, tokens: torch.Tensor) -> Documents | None:
    """The documents of ``tokens`` under model ``cfg``: None when the model is not packed."""
    return documents(tokens, eod_token(cfg)) if cfg.pack_docs else None


def shard_documents(cfg, tokens: torch.Tensor, columns: torch.Tensor) -> Documents | None:
    """The sequence positions ``columns`` of ``tokens`` [b, s] (a context-parallel shard) as
    ``Documents``: their within-document positions when the model is packed, their global
    ones otherwise -- what RoPE and the position embedding need; None when the model
    neither packs nor rotates (the shard's learned positions are ``columns`` themselves)."""
    if not (cfg.pack_docs or cfg.rope_theta):
        return None
    docs = documents_of(cfg, tokens)
    if docs is None:
        b, s = tokens.shape
        col = torch.arange(s, device=tokens.device).expand(b, s)
        docs = Documents(torch.zeros_like(tokens), col)
    return docs.take(columns)


def allowed(q_ids: torch.Tensor, k_ids: torch.Tensor, q_cols: torch.Tensor,
            k_cols: torch.Tensor) -> torch.Tensor:
    """[b, 1, nq, nk] boolean mask: query (column q_cols[i]) may attend to key (column
    k_cols[j]) iff it is not later in the sequence (causal) and in the same document
    (Megatron's reset_attention_mask). ``q_ids``/``k_ids``: [b, nq] / [b, nk] document
    ids; ``q_cols``/``k_cols``: the global sequence positions of those rows."""
    same = q_ids[:, :, None] == k_ids[:, None, :]
    causal = q_cols[:, None] >= k_cols[None, :]
    return (same & causal)[:, None]


def self_mask(docs: Documents) -> torch.Tensor:
    """The attention mask of a whole sequence against itself (positions 0..s-1)."""
    cols = torch.arange(docs.ids.shape[1], device=docs.ids.device)
    return allowed(docs.ids, docs.ids, cols, cols)


def pack_batch(inputs: torch.Tensor, targets: torch.Tensor, max_docs: int, eod: int,
               seed: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A synthetic batch packed with documents: each sample's token stream (inputs and the
    last target) has no EOD but at the end of each of its 1..``max_docs`` documents but the
    last, at positions drawn per sample (deterministic in seed and step), so that samples,
    micro-batches and sequence shards hold different boundaries."""
    stream = torch.cat([inputs, targets[:, -1:]], dim=1) % eod  # ids < eod: no stray EOD
    b, n = stream.shape
    g = torch.Generator().manual_seed(seed * 4099 + step * 7727 + 31)
    docs = torch.randint(1, max_docs + 1, (b,), generator=g)
    for i in range(b):
        cuts = torch.randperm(n - 2, generator=g)[: int(docs[i]) - 1] + 1  # in [1, n-2]
        stream[i, cuts] = eod
    return stream[:, :-1].contiguous(), stream[:, 1:].contiguous()
