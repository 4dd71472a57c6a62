"""User-style schemes for tests/equivalence/test_memory_holders.py and
tests/cli/test_verify_states.py: native DDP keeping one full copy of its parameters where the
memory tracker once did not look -- a ``functools.partial``, a closure cell, a bound method
(issue 20, sec. 7) -- and the same scheme keeping nothing (no false alarm)."""
from __future__ import annotations

import functools

import torch

from impls.data.ddp import NativeDDP


def _copy(scheme) -> list[torch.Tensor]:
    return [p.detach().clone() for p in scheme.model.parameters()]


class Clean(NativeDDP):
    """Native DDP, registered under this file's path: the control."""


class InPartial(NativeDDP):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.restore = functools.partial(torch.cat, _copy(self))


class InClosure(NativeDDP):
    def __init__(self, ctx):
        super().__init__(ctx)
        saved = _copy(self)
        self.restore = lambda: saved


class _Snapshot:
    def __init__(self, tensors):
        self.tensors = tensors

    def restore(self):
        return self.tensors


class InBoundMethod(NativeDDP):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.restore = _Snapshot(_copy(self)).restore  # only the bound method holds it
