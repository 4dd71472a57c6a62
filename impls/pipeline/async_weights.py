"""The weight rules of the asynchronous pipelines (semantics: see ``asynchronous``).

``PipeDreamWeights``: a per-stage optimizer stepped after every backward, forwards on the
stashed weight version their micro-batch entered with. ``TwoBWWeights``: the synchronous
rule (accumulate over the m micro-batches, one step per batch) run on a one-step-old shadow,
with the optimizer on a separate master copy.
"""
from __future__ import annotations

import torch

from parbench.memory import optimizer_tensors
from parbench.model import make_optimizer

from .weights import StageSlot, SyncWeights, WeightRule


def snapshot(named) -> dict[str, torch.Tensor]:
    """Detached copies of ``(name, tensor)`` pairs as parameters (a stashed weight version is
    weight memory: the memory tracker counts it with the parameters)."""
    return {n: torch.nn.Parameter(p.detach().clone()) for n, p in named}


def stage_delay(p: int, stage: int) -> int:
    """Updates a stage is behind the micro-batch entering the pipeline (1F1B warm-up)."""
    return p - 1 - stage


class PipeDreamWeights(WeightRule):
    """Per-stage optimizer updated after every backward; stashed versions for forwards."""

    #: forwards run on stashed copies, so gradients come back through ``on_grads``
    accumulates_in_grad = False

    def __init__(self, slots: list[StageSlot], run_cfg, *, p: int, m: int):
        super().__init__(slots)
        self.p, self.m = p, m
        self.opts = {id(s): make_optimizer(s.params, run_cfg) for s in slots}
        self.versions = {id(s): {0: snapshot(zip(s.names, s.params))} for s in slots}
        self.updates = {id(s): 0 for s in slots}
        self.first_mb = 0  # global index of this step's micro-batch 0
        self.grad_mean = {id(s): [torch.zeros_like(p) for p in s.params] for s in slots}

    def loss_divisor(self, m: int) -> int:
        return 1  # every micro-batch is a minibatch of its own

    def step_begin(self) -> None:
        for s in self.slots:
            for g in self.grad_mean[id(s)]:
                g.zero_()

    def _version(self, slot: StageSlot, global_mb: int) -> int:
        return max(0, global_mb - stage_delay(self.p, slot.stage))

    def forward_params(self, slot, mb):
        version = self._version(slot, self.first_mb + mb)
        versions = self.versions[id(slot)]
        if version not in versions:
            raise RuntimeError(f"pipedream: stage {slot.stage} has no weight version "
                               f"{version} (kept {sorted(versions)})")
        for old in [k for k in versions if k < version]:
            del versions[old]
        return versions[version]

    def on_grads(self, slot, mb, params, grads) -> None:
        for p, g, acc in zip(slot.params, grads, self.grad_mean[id(slot)]):
            p.grad = g
            acc.add_(g / self.m)
        self.opts[id(slot)].step()
        self.updates[id(slot)] += 1
        self.versions[id(slot)][self.updates[id(slot)]] = snapshot(zip(slot.names,
                                                                       slot.params))

    def step_end(self) -> None:
        self.first_mb += self.m
        for s in self.slots:  # keep what the next step's warm-up forwards need
            keep = self._version(s, self.first_mb)
            versions = self.versions[id(s)]
            for old in [k for k in versions if k < keep]:
                del versions[old]

    def reported_grads(self, slot):
        return self.grad_mean[id(slot)]

    def state_tensors(self) -> dict:
        params = [p for s in self.slots for p in s.params]
        return {"params": params, "grads": [p.grad for p in params if p.grad is not None],
                "optimizer": [t for o in self.opts.values() for t in optimizer_tensors(o)],
                "stash": [t for s in self.slots for d in self.versions[id(s)].values()
                          for t in d.values()]}


class TwoBWWeights(SyncWeights):
    """The synchronous rule on a shadow: the stage modules hold W(t-1), whose gradients
    accumulate in its ``.grad`` as in ``SyncWeights``; the optimizer updates the master W(t),
    and the shadow then becomes the old master."""

    def __init__(self, slots: list[StageSlot], run_cfg):
        self.master = {id(s): [torch.nn.Parameter(p.detach().clone()) for p in s.params]
                       for s in slots}
        super().__init__(slots, run_cfg)

    def optimized_params(self) -> list[torch.Tensor]:
        return [t for s in self.slots for t in self.master[id(s)]]

    def step_end(self) -> None:
        older = {k: [t.detach().clone() for t in v] for k, v in self.master.items()}
        for s in self.slots:
            for mp, p in zip(self.master[id(s)], s.params):
                mp.grad = p.grad.detach().clone()
        self.opt.step()  # W(t+1) = W(t) - lr * grad f(W(t-1))
        with torch.no_grad():
            for s in self.slots:  # the shadow becomes W(t)
                for p, w in zip(s.params, older[id(s)]):
                    p.copy_(w)
        for v in self.master.values():
            for mp in v:
                mp.grad = None

    def reported_params(self, slot):
        return self.master[id(slot)]

    def state_tensors(self) -> dict:
        params = [p for s in self.slots for p in s.params]
        return {"params": [t for s in self.slots for t in self.master[id(s)]],
                "grads": [p.grad for p in params if p.grad is not None],
                "optimizer": optimizer_tensors(self.opt), "stash": params}
