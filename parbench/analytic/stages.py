"""Which layers each pipeline stage holds: ``split_layers`` (stages of a rank, with virtual
stages) and ``stage_layer_indices`` (the global layer indices of each stage)."""
from __future__ import annotations

from typing import Sequence

from ..layout import Layout, pipeline_chunks
from .shape import require_positive_int


def split_layers(num_layers: int, pp: int, vpp: int = 1,
                 layers_per_stage: Sequence[int] | None = None) -> list[int]:
    """Layers held by each pipeline rank.

    Default: an even split, refusing ``num_layers`` not divisible by ``pp * vpp`` (with
    interleaving each of the ``vpp`` chunks per rank must hold the same number of layers).
    ``layers_per_stage`` gives an explicit split, which must have ``pp`` entries of at least
    one layer each, summing to ``num_layers``.
    """
    require_positive_int("pp", pp)
    require_positive_int("vpp", vpp)
    require_positive_int("num_layers", num_layers)
    if layers_per_stage is not None:
        split = list(layers_per_stage)
        if len(split) != pp:
            raise ValueError(f"layers_per_stage={split} must have pp={pp} entries")
        for n in split:
            require_positive_int("layers_per_stage entry", n)
        if sum(split) != num_layers:
            raise ValueError(f"layers_per_stage={split} sums to {sum(split)}, "
                             f"not num_layers={num_layers}")
        return split
    if num_layers % (pp * vpp):
        rule = f"pp*vpp={pp * vpp}" if vpp > 1 else f"pp={pp}"
        raise ValueError(f"{rule} does not divide num_layers={num_layers}")
    return [num_layers // pp] * pp


def stage_layer_indices(num_layers: int, pp: int, vpp: int = 1,
                        layers_per_stage: Sequence[int] | None = None, *, first: int = 0,
                        last: int = 0) -> list[list[int]]:
    """The global (0-based) indices of the layers each pipeline rank holds.

    Virtual stage ``c * pp + r`` (chunk c of rank r) holds the next ``pipeline_chunks``
    layers in the model's order: even, ``[(c pp + r) n, (c pp + r + 1) n)`` with
    n = num_layers / (pp vpp) (Narayanan et al. 2021, Sec. 2.2, interleaved schedule); with an
    uneven ``first`` / ``last`` rank, Megatron-Core's ``get_transformer_layer_offset``.
    An explicit ``layers_per_stage`` split is contiguous per rank.
    """
    if layers_per_stage is not None:
        split = split_layers(num_layers, pp, vpp, layers_per_stage)
        starts = [sum(split[:i]) for i in range(pp)]
        return [list(range(a, a + n)) for a, n in zip(starts, split)]
    require_positive_int("num_layers", num_layers)
    chunks = pipeline_chunks(num_layers, pp, vpp, first, last)
    out: list[list[int]] = [[] for _ in range(pp)]
    lo = 0
    for vs, n in enumerate(chunks):
        out[vs % pp].extend(range(lo, lo + n))
        lo += n
    return out


def layout_stage_indices(num_layers: int, lay: Layout) -> list[list[int]]:
    """:func:`stage_layer_indices` of a layout (its vpp and uneven ends)."""
    return stage_layer_indices(num_layers, lay.pp, lay.vpp, first=lay.first_stage_layers,
                               last=lay.last_stage_layers)
