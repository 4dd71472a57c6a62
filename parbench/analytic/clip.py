"""Gradient clipping by global norm: the collectives it adds to a step.

Clipping (Pascanu, Mikolov, Bengio 2013, Alg. 1; Megatron-LM ``--clip-grad``) needs the norm
of the whole model's gradient. A rank holding part of it adds its squares and the 1-element
fp32 sum is all-reduced over every group the gradient is spread over: Megatron-LM's
``clip_grad_norm_fp32`` all-reduces it over the model-parallel group (tp, pp), over the
data-parallel group with the distributed optimizer (ZeRO), and over the expert groups for
expert parameters. parbench's native schemes make one all-reduce per spread mesh axis, so the
ledger books each on its axis; a replicated gradient (plain data parallelism after its
all-reduce) needs none.

Per step and rank: one ``all_reduce`` of 4 bytes per axis of size > 1 that the gradient is
spread over, i.e. 2(n-1)/n x 4 wire bytes on an axis of n ranks (``comm.wire_factor``).
"""
from __future__ import annotations

from .comm import Transfer

#: the norm's message: one fp32 element
NORM_BYTES = 4


def norm_transfers(spread: dict[str, int], clip_grad: float) -> list[Transfer]:
    """The norm's all-reduces on the axes ``spread`` ({axis: size}) that the gradient is
    spread over; none when the run does not clip (``clip_grad`` 0) or an axis has one rank."""
    if not clip_grad:
        return []
    return [Transfer(axis, "all_reduce", n, NORM_BYTES, 1, "gradient norm (clipping)")
            for axis, n in spread.items() if n > 1]


def add_to(wire: dict[str, float], calls: dict[str, int] | None, spread: dict[str, int],
           clip_grad: float) -> None:
    """Add the norm's all-reduces to one rank's predicted ``wire`` bytes and ``calls`` per
    axis, in place."""
    for t in norm_transfers(spread, clip_grad):
        wire[t.axis] = wire.get(t.axis, 0) + t.total_wire_bytes
        if calls is not None:
            calls[t.axis] = calls.get(t.axis, 0) + t.count
