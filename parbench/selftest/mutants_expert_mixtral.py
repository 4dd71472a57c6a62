"""Realistic bugs in Mixtral-style experts (Jiang et al. 2024, "Mixtral of Experts",
Sec. 2.1: SwiGLU experts without biases): each runs ``expert.alltoall`` on ``mixtral-tiny``
(8 experts, top-2, every layer MoE) at ep = dp = 2.

- the expert's fused fc1 read as [up; gate] instead of [gate; up] -- the w1 / w3 order of a
  checkpoint converted between Hugging Face's three matrices and a fused [gate; up] layout;
- the SiLU applied to the product instead of the gate (silu(gate * up)): an activation that
  still trains, with the same shapes and traffic."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from impls.expert.dispatch import ExpertDispatch
from impls.expert.scheme import ExpertAllToAll

from .catalogue import mutant

#: the preset and its expert count (the family's case sets num_experts=4)
MIXTRAL = {"model": "mixtral-tiny", "num_experts": "8"}


def _swiglu_experts(local, experts, act) -> torch.Tensor:
    """Every local expert on its rows with ``act(gate, up)`` in place of silu(gate) * up."""
    out = []
    for i, ex in enumerate(experts):
        gate, up = F.linear(local[i], ex.fc1.weight, ex.fc1.bias).chunk(2, dim=-1)
        out.append(F.linear(act(gate, up), ex.fc2.weight, ex.fc2.bias))
    return torch.stack(out)


class _UpGateDispatch(ExpertDispatch):
    @staticmethod
    def run_experts(local, experts):
        return _swiglu_experts(local, experts, lambda gate, up: F.silu(up) * gate)


@mutant("ep-swiglu-gate-up-swapped", base="expert.alltoall", overrides=MIXTRAL,
        bug="SwiGLU experts read their fused fc1 as [up; gate] (the w1 / w3 order swapped "
            "in a checkpoint conversion)")
class SwigluGateUpSwapped(ExpertAllToAll):
    dispatch_class = _UpGateDispatch


class _SiluOfProductDispatch(ExpertDispatch):
    @staticmethod
    def run_experts(local, experts):
        return _swiglu_experts(local, experts, lambda gate, up: F.silu(gate * up))


@mutant("ep-swiglu-silu-of-product", base="expert.alltoall", overrides=MIXTRAL,
        bug="SwiGLU experts compute silu(gate * up) instead of silu(gate) * up")
class SwigluSiluOfProduct(ExpertAllToAll):
    dispatch_class = _SiluOfProductDispatch
