"""Pieces shared by the schemes: slicing the global batch, optimizer-state tensors."""
from __future__ import annotations

import torch

from parbench.scheme import Scheme


def dp_slice(x: torch.Tensor, dp_rank: int, dp: int) -> torch.Tensor:
    """Rows of the global batch that data-parallel rank ``dp_rank`` trains on."""
    per = x.shape[0] // dp
    return x[dp_rank * per:(dp_rank + 1) * per]


def microbatches(x: torch.Tensor, y: torch.Tensor, m: int):
    """Split a local batch into ``m`` equal micro-batches."""
    return list(zip(x.chunk(m), y.chunk(m)))


def optimizer_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor in the optimizer's state (Adam moments and step counters)."""
    out = []
    for st in opt.state.values():
        out.extend(v for v in st.values() if isinstance(v, torch.Tensor))
    return out


def optimizer_bookkeeping_bytes(num_param_tensors: int, optimizer: str) -> int:
    """torch AdamW keeps a float32 ``step`` scalar per parameter tensor (4 bytes each)."""
    return 4 * num_param_tensors if optimizer == "adamw" else 0


def optimizer_state_bytes(numel: int, num_param_tensors: int, optimizer: str,
                          state_elem_bytes: int = 4) -> int:
    """AdamW: two moments per element plus the step scalars; SGD without momentum: none."""
    if optimizer == "sgd":
        return 0
    return 2 * numel * state_elem_bytes + optimizer_bookkeeping_bytes(num_param_tensors,
                                                                      optimizer)


class ReplicaMixin:
    """For schemes whose rank holds a whole ``self.model`` with ordinary ``.grad``s."""

    def full_params(self):
        return {n: p.detach() for n, p in self.model.named_parameters()}

    def full_grads(self):
        return {n: p.grad.detach() for n, p in self.model.named_parameters()}


class DataParallelScheme(Scheme):
    """Base of the data-parallel family: the dp group, this rank's place in it, and its
    micro-batches of the global batch (each replica trains on an equal slice)."""

    family = "data"
    uses = ("dp",)

    def __init__(self, ctx):
        super().__init__(ctx)
        self.group = ctx.mesh.group("dp")
        self.d = ctx.mesh.size("dp")
        self.r = ctx.mesh.index("dp")

    def local_microbatches(self, inputs: torch.Tensor, targets: torch.Tensor):
        dev = self.ctx.device
        x = dp_slice(inputs, self.r, self.d).to(dev)
        y = dp_slice(targets, self.r, self.d).to(dev)
        return microbatches(x, y, self.ctx.parallel.num_microbatches)
