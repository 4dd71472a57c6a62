"""Module probes: which module of a rank computes which module of the reference model, on
which part of the global batch (issue 20, section 5: name the first diverging module).

When a case fails, the verdict reruns its checked steps with hooks on the modules a scheme
maps (``Scheme.module_probes``) and compares each one's forward output and input gradient
with the golden model's at the scheme's own weights (``parbench.verdict.divergence``), to
name the first module that diverges -- in forward order, then backward -- with its rank and
step, as an engineer bisecting the model layer by layer would.

A probe says: module ``module`` of this rank computes reference module ``name``
(``blocks.1.attn``); its i-th forward call computes ``golden_output[calls[i]]``, where the
golden output is the reference module's on the whole global batch -- ``calls[i]`` is an index
(a slice of batch rows; or a tuple (rows, sequence positions) for a sequence shard, and
(rows, positions, features) for a shard of the hidden dimension too); the
gradient reaching the module's input in that call, times ``grad_scale``, is the golden one at
the same index (a data-parallel rank's loss is the mean over its own rows, 1/dp of the global
batch, so its input gradients are dp times the golden run's: ``grad_scale = 1/dp``).
A module that computes sequence-first (``[s, b, ...]``, Megatron's layout) says so
(``sequence_first``): its tensors are transposed to the golden ``[b, s, ...]`` before the
index applies. Backward calls are matched to forward calls in order, so a scheme maps a
module only where its backwards run in the order of its forwards (a split backward that
re-enters the graph for W, or token slices, would need calls of their own).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

#: the reference model's modules a probe names: the embedding, each block's LayerNorms,
#: attention and MLP, and the head (``parbench.model.gpt``)
PROBED = re.compile(r"embed|head|blocks\.\d+\.(ln1|attn|ln2|mlp)")


@dataclass
class ModuleProbe:
    """One module of this rank that computes reference module ``name`` (module docstring)."""

    name: str
    module: torch.nn.Module
    #: per forward call, in order: the index of the golden output it computes
    calls: list[Any]
    grad_scale: float = 1.0
    #: the module's tensors are [s, b, ...] (Megatron's layout): compared transposed
    sequence_first: bool = False

    def batch_first(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (one of the module's outputs or input gradients) in the golden layout."""
        return t.transpose(0, 1) if self.sequence_first and t.dim() >= 2 else t


def reference_probes(model: torch.nn.Module, calls: list[Any], grad_scale: float = 1.0,
                     prefix: str = "") -> list[ModuleProbe]:
    """Probes of every probed module of ``model``, a module named as the reference model is
    (the whole GPT, or a stage of it: block ``i`` keeps its name ``blocks.{i}``), each call
    of which computes ``calls[i]`` of the golden outputs."""
    return [ModuleProbe(prefix + name, mod, list(calls), grad_scale)
            for name, mod in model.named_modules() if PROBED.fullmatch(prefix + name)]


def microbatch_rows(first_row: int, rows: int, num_microbatches: int) -> list[slice]:
    """The global-batch rows of each micro-batch of a rank whose rows start at ``first_row``
    (``parbench.batching``: a rank's rows split into equal micro-batches, in order)."""
    per = rows // num_microbatches
    return [slice(first_row + i * per, first_row + (i + 1) * per)
            for i in range(num_microbatches)]


def reference_order(num_layers: int) -> list[str]:
    """The probed modules of the reference model in forward order."""
    blocks = [f"blocks.{i}.{m}" for i in range(num_layers) for m in ("ln1", "attn", "ln2", "mlp")]
    return ["embed", *blocks, "head"]
