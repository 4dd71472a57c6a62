"""Probe points of the tensor-parallel models (issue 20, sec. 5: name the first diverging
module).

The native tensor-parallel models are functional -- one module holding every local shard --
so the reference model's modules (``embed``, ``blocks.i.ln1`` / ``attn`` / ``ln2`` / ``mlp``,
``head``) are not modules of theirs that ``parbench.verdict.divergence.Recorder`` could hook.
A model that mixes in :class:`Tapped` runs each such part through :meth:`Tapped.tap`: plain
calls, until ``install_taps`` gives the parts a :class:`Tap` each (an identity module around
the part's function), whose forward hooks see the part's input and output as a reference
module's would. The taps are created only when a failing case is localised
(``Scheme.module_probes``) and are not submodules (no parameter, no state, no bytes).

A tap fires only while autograd records (``torch.is_grad_enabled``): under full
recomputation a layer runs twice, once without a graph in forward and again in backward, and
the probe's calls must be one per micro-batch, the graph's (whose input gradients it reads).
"""
from __future__ import annotations

import torch
import torch.nn as nn

#: the parts of a block a probe names, in forward order (``parbench.probes.PROBED``)
BLOCK_PARTS = ("ln1", "attn", "ln2", "mlp")


class Tap(nn.Module):
    """``tap(x, fn, *args)`` is ``fn(x, *args)``: a module whose hooks see ``x`` and the
    result."""

    def forward(self, x, fn, *args):
        return fn(x, *args)


def reference_parts(lo: int, hi: int, first: bool, last: bool) -> list[str]:
    """The reference modules a stage of layers [lo, hi) computes (the embedding when
    ``first``, the head when ``last``), in forward order."""
    blocks = [f"blocks.{i}.{part}" for i in range(lo, hi) for part in BLOCK_PARTS]
    return (["embed"] if first else []) + blocks + (["head"] if last else [])


class Tapped:
    """Mixin of a functional model: ``tap(name, fn, x, *args)`` around each reference part."""

    #: reference module name -> its Tap (None: not installed, every part a plain call)
    taps: dict[str, Tap] | None = None

    def install_taps(self, names: list[str]) -> dict[str, Tap]:
        """A Tap for each of ``names`` (kept: installing again returns the same ones)."""
        if self.taps is None:
            self.taps = {name: Tap() for name in names}
        return self.taps

    def tap(self, name: str, fn, x, *args):
        """``fn(x, *args)``, through ``name``'s Tap when one is installed and autograd
        records (module docstring)."""
        tap = self.taps.get(name) if self.taps else None
        if tap is None or not torch.is_grad_enabled():
            return fn(x, *args)
        return tap(x, fn, *args)
