"""The rules of a pipeline's layer split (even, or Megatron-Core's uneven end ranks) as
messages, and the layers of one virtual stage: pure, no parbench import (``layout`` raises
the messages as ``ConfigError``)."""
from __future__ import annotations


def chunk_range(chunks, num_layers: int, stage: int) -> tuple[int, int]:
    """Layers [lo, hi) of virtual stage ``stage`` when the stages hold ``chunks`` layers
    each, in the model's order (:func:`pipeline_chunks`); a list of another model refused."""
    if sum(chunks) != num_layers or not 0 <= stage < len(chunks):
        raise ValueError(f"chunks={list(chunks)} are not stages of num_layers={num_layers} "
                         f"with a stage {stage}")
    lo = sum(chunks[:stage])
    return lo, lo + chunks[stage]


def split_rules(num_layers: int, pp: int, vpp: int, first: int, last: int):
    """The broken rules of a split of ``num_layers`` over pp ranks of vpp chunks each."""
    if not (first or last):
        if num_layers % (pp * vpp):
            yield f"pp*vpp={pp * vpp} does not divide num_layers={num_layers}"
        return
    middle_ranks = pp - bool(first) - bool(last)
    rest = num_layers - first - last
    ends = f"first_stage_layers={first}, last_stage_layers={last}"
    if rest < 0 or bool(rest) != bool(middle_ranks):
        yield (f"{ends} leave {rest} layers of num_layers={num_layers} for {middle_ranks} "
               "other pipeline ranks (each of them needs layers, and every layer needs a "
               "rank)")
    elif middle_ranks and rest % (middle_ranks * vpp):
        yield (f"{ends}: the {rest} other layers of num_layers={num_layers} do not split "
               f"evenly over the {middle_ranks} other pipeline ranks x vpp={vpp} chunks")
