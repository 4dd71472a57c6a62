"""Where a rank's piece of a parameter sits in the full tensor, and the full tensors back.

A :class:`Placement` names the full parameter, its full shape and, per dimension, the full
indices a rank holds (``None``: the whole dimension). Indices at or beyond the full size are
padding (the padded vocabulary). Every tensor-parallel scheme builds its local parameters by
``take`` from the reference model's full weights, and returns them unsharded by
:func:`gather_full`: one all-gather per sharded tensor over the group that splits it, every
rank's piece put back where its placement says (this rank's own piece last, so that a rank
reports what it holds).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

#: ``index(rank)`` -> per-dimension full indices (a LongTensor, or None for the whole dim)
IndexFn = Callable[[int], tuple]


@dataclass
class Placement:
    full_name: str
    full_shape: tuple[int, ...]
    #: None: replicated on every rank of the group (each rank reports its own)
    index: IndexFn | None = None

    @property
    def replicated(self) -> bool:
        return self.index is None


def blocks(start: int, length: int) -> torch.Tensor:
    return torch.arange(start, start + length)


def take(full: torch.Tensor, index: tuple) -> torch.Tensor:
    """This rank's piece of ``full`` (padding indices read as zeros)."""
    out = full
    for dim, ix in enumerate(index):
        if ix is None:
            continue
        size = full.shape[dim]
        pad = int((ix >= size).sum())
        inside = out.index_select(dim, ix[ix < size])
        if pad:
            shape = list(inside.shape)
            shape[dim] = pad
            inside = torch.cat([inside, inside.new_zeros(shape)], dim=dim)
        out = inside
    return out.clone().contiguous()


def place(full: torch.Tensor, piece: torch.Tensor, index: tuple) -> None:
    """Write ``piece`` into ``full`` where ``index`` says (padding dropped)."""
    targets = []
    for dim, ix in enumerate(index):
        if ix is None:
            ix = torch.arange(full.shape[dim])
        keep = ix < full.shape[dim]
        piece = piece.index_select(dim, keep.nonzero().squeeze(1))
        targets.append(ix[keep])
    grids = torch.meshgrid(*targets, indexing="ij")
    full[grids] = piece


def _same(a: tuple, b: tuple) -> bool:
    return all((x is None and y is None) or
               (x is not None and y is not None and torch.equal(x, y)) for x, y in zip(a, b))


def first_holder(pl: Placement, my_index: int) -> bool:
    """Is ``my_index`` the lowest index of the group holding this piece of ``pl``? A
    replicated parameter belongs to index 0 only, a shard to the first rank that holds it
    (Megatron-LM's ``param_is_not_tensor_parallel_duplicate``, generalised to pieces
    replicated over some grid axes): the ranks that count a piece in the gradient norm."""
    if pl.replicated:
        return my_index == 0
    mine = pl.index(my_index)
    return not any(_same(pl.index(t), mine) for t in range(my_index))


def gather_full(named: dict[str, tuple[torch.Tensor, Placement]], group, group_ranks: list[int],
                my_index: int) -> dict[str, torch.Tensor]:
    """Full tensors from this rank's pieces (collective over ``group``; not the scheme's
    traffic: call it under ``comm.unrecorded()``). ``group_ranks[i]`` is the rank whose
    placement index is ``i``."""
    out = {}
    n = len(group_ranks)
    for name, (local, pl) in named.items():
        local = local.detach()
        if pl.replicated:
            out[pl.full_name] = local.clone()
            continue
        if n == 1:  # the one piece is the whole tensor, in the placement's row order
            out[pl.full_name] = torch.zeros(pl.full_shape, dtype=local.dtype,
                                            device=local.device)
            place(out[pl.full_name], local, pl.index(0))
            continue
        flat = torch.empty(n * local.numel(), dtype=local.dtype, device=local.device)
        dist.all_gather_into_tensor(flat, local.contiguous().view(-1), group=group)
        pieces = flat.view(n, *local.shape)
        full = torch.zeros(pl.full_shape, dtype=local.dtype, device=local.device)
        for i in [i for i in range(n) if i != my_index] + [my_index]:
            place(full, pieces[i], pl.index(i))
        out[pl.full_name] = full
    return out
