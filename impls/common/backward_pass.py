"""Which part of a split backward is running: the input gradient (B), the weight gradients (W)
or neither (an ordinary, fused backward).

Zero Bubble pipeline parallelism (Qi et al. 2024, Sec. 2) runs a stage's backward in two
passes over the same autograd graph: B asks only for the gradient of the stage input, W
re-enters the graph's weight nodes later. Built-in nodes compute only the gradients the
engine asks for; a custom ``autograd.Function`` cannot tell which it is asked for (its
``needs_input_grad`` is fixed at forward time), so a fused tensor-parallel linear would run
its input-gradient collective in B and again in W. Such functions read :func:`current` and
do only their pass's part -- what Megatron-LM's zero-bubble support does by deferring the
weight-gradient GEMM of its linear layers to a store that W drains.

A process-wide value, not a thread-local or context variable: on CUDA the autograd engine
runs a backward on its device thread while the caller waits, and must see the caller's pass.
"""
from __future__ import annotations

import contextlib

INPUT = "input"
WEIGHT = "weight"

_state: list[str | None] = [None]


def current() -> str | None:
    """``INPUT`` during B, ``WEIGHT`` during W, None during a fused backward."""
    return _state[-1]


@contextlib.contextmanager
def running(kind: str | None):
    """Mark the backward calls inside as ``kind`` (None: fused)."""
    _state.append(kind)
    try:
        yield
    finally:
        _state.pop()
