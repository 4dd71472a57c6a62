"""``gather_full`` on a one-rank group: the rank's one piece is the whole tensor in its
placement's row order (e.g. Megatron-Core's group-interleaved ``linear_qkv`` at tp = 1), put
back in the reference order -- not reported as stored."""
from __future__ import annotations

import torch

from impls.tensor.shards import Placement, gather_full, take


def test_one_rank_piece_is_put_back_in_reference_order():
    full = torch.arange(12.0).view(6, 2)
    order = torch.tensor([0, 3, 1, 4, 2, 5])  # interleaved rows, as one rank stores them
    pl = Placement("w", (6, 2), lambda r: (order, None))
    piece = take(full, pl.index(0))
    assert not torch.equal(piece, full)
    out = gather_full({"w": (piece, pl)}, None, [0], 0)  # no collective on one rank
    assert torch.equal(out["w"], full)
