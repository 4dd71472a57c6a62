"""Weight rules: which parameters a forward runs on, where a backward's gradients go, and
when the optimizer steps. The executor calls only the hooks of :class:`WeightRule`.

``SyncWeights`` is the synchronous rule every flush schedule uses (one weight version,
gradients accumulated over the m micro-batches, one optimizer step per step). The
asynchronous rules (PipeDream, PipeDream-2BW) are in ``async_weights``. What a rule holds
is measured by the memory tracker from the objects reachable from the scheme
(``parbench.memory.live_model_states``), not listed by the rule.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from parbench.model import make_optimizer


@dataclass
class StageSlot:
    """One (pipe, stage) held by this rank: its module and parameter list."""

    pipe: int
    stage: int
    module: torch.nn.Module
    names: list[str] = field(default_factory=list)
    params: list[torch.Tensor] = field(default_factory=list)

    def __post_init__(self):
        pairs = list(self.module.named_parameters())
        self.names = [n for n, _ in pairs]
        self.params = [p for _, p in pairs]


class WeightRule(ABC):
    """The weight semantics of a pipeline: the hooks the executor and the scheme call."""

    #: True when a fused backward may accumulate straight into ``p.grad`` of the parameters
    #: the forward ran on (``on_grads`` is then not called for fused backwards)
    accumulates_in_grad: ClassVar[bool]

    def __init__(self, slots: list[StageSlot]):
        self.slots = slots

    @abstractmethod
    def loss_divisor(self, m: int) -> int:
        """What each micro-batch loss is divided by before its backward."""

    @abstractmethod
    def forward_params(self, slot: StageSlot, mb: int) -> dict[str, torch.Tensor] | None:
        """The parameters the forward of micro-batch ``mb`` (its index in the run for a
        continuous pipeline, in the step otherwise) runs on (None: the module's own)."""

    @abstractmethod
    def on_grads(self, slot: StageSlot, mb: int, params: list[torch.Tensor],
                 grads: list[torch.Tensor | None]) -> None:
        """Receive the weight gradients of one backward (``params``: what the forward ran on)."""

    @abstractmethod
    def step_begin(self) -> None:
        """Before the first action of a step."""

    @abstractmethod
    def step_end(self) -> None:
        """After the last action of a step (and the replica gradient exchange)."""

    def reported_params(self, slot: StageSlot) -> list[torch.Tensor]:
        """The parameters compared with the reference after a step."""
        return slot.params

    def reported_grads(self, slot: StageSlot) -> list[torch.Tensor]:
        """The gradients compared with the reference after a step."""
        return [p.grad for p in slot.params]


class SyncWeights(WeightRule):
    """Synchronous semantics: one weight version; gradients accumulate into ``p.grad``; one
    optimizer step per step."""

    accumulates_in_grad = True

    def __init__(self, slots: list[StageSlot], run_cfg):
        super().__init__(slots)
        self.run_cfg = run_cfg
        self.opt = self.make_optimizer([p for s in self.slots for p in s.params])

    def make_optimizer(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        """The run's optimizer over ``params`` (the self-test's mutants swap in buggy ones)."""
        return make_optimizer(params, self.run_cfg)

    def loss_divisor(self, m: int) -> int:
        """Each micro-batch loss is divided by m: accumulated gradients = full-batch mean."""
        return m

    def forward_params(self, slot, mb):
        return None  # the module's own parameters

    def on_grads(self, slot, mb, params, grads) -> None:
        for p, g in zip(params, grads):
            if g is not None:
                p.grad.add_(g)

    def step_begin(self) -> None:
        for slot in self.slots:
            for p in slot.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                else:
                    p.grad.zero_()

    def step_end(self) -> None:
        self.opt.step()
