"""The weight rules of the asynchronous pipelines (semantics: see ``asynchronous``).

Both keep a stage's weight versions in a :class:`VersionRing` of n copies -- version v in
copy v mod n -- and write every new version into the copy whose version no micro-batch
needs any more, so the weights in memory are exactly the versions the rule needs:

* ``PipeDreamWeights`` (Narayanan et al. 2019, Sec. 3.3, weight stashing): n = p - s on
  stage s. Micro-batch g runs stage s on version max(0, g - (p-1-s)); one optimizer step
  after every backward. When the backward of g ends, version g - (p-1-s) -- g's own -- is
  the oldest any micro-batch in flight uses, so version g+1 takes its copy.
* ``TwoBWWeights`` (Narayanan et al. 2021, Sec. 3.1, double buffering): n = 2. Every
  micro-batch of batch t runs on W(t-1) (W(-1) = W(0)); their gradients accumulate in one
  buffer; after the batch's last backward on the stage, W(t+1) = opt(W(t), buffer) goes
  into the copy W(t-1) held -- free, since the batch that ran on it is done, while batch
  t+1's first forwards already run on W(t) (hence m >= p: batch t+1 cannot reach a stage
  before batch t-1 has left it).

The optimizer steps handles (``nn.Parameter``s) that alias the newest copy, so its state
(AdamW moments, step counters) is one per parameter whatever copy a version lands in; the
stage module's own parameters are copy 0.
"""
from __future__ import annotations

import torch

from parbench.model import make_optimizer

from .weights import StageSlot, WeightRule


def allocate_states(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Allocate Adam-family states up front, as ``torch.optim.Adam._init_group`` would on
    the first step (same keys, dtypes and zero values, so the arithmetic is unchanged): a
    stage of a continuous pipeline may apply its first update only in the second step, and
    the states it holds are the same in every step."""
    for group in opt.param_groups:
        if "betas" not in group:
            continue  # SGD without momentum keeps no state
        on_device = group.get("capturable", False) or group.get("fused", False)
        for p in group["params"]:
            state = opt.state[p]
            if state:
                continue
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device) \
                if on_device else torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return opt


def stage_delay(p: int, stage: int) -> int:
    """Updates a stage is behind the micro-batch entering the pipeline (1F1B warm-up)."""
    return p - 1 - stage


class VersionRing:
    """n weight versions of one stage; version v lives in copy v mod n."""

    def __init__(self, slot: StageSlot, n: int, make_opt):
        self.names = slot.names
        self.n = n
        base = slot.params  # the module's parameters hold version 0
        self.copies = [base] + [[torch.nn.Parameter(p.detach().clone()) for p in base]
                                for _ in range(n - 1)]
        # the optimizer's handles: each aliases the newest copy's storage, with a version
        # counter of its own (``.data``, not ``detach``), so that a step does not look like
        # a change of the copy a graph in flight saved; overwriting a copy bumps that copy's
        # counter (``copy_``), so autograd still refuses a version overwritten too early
        self.handles = [torch.nn.Parameter(p.data) for p in base]
        self.opt = allocate_states(make_opt(self.handles))
        self.newest = 0

    def params(self, version: int) -> list[torch.Tensor]:
        if not self.newest - self.n < version <= self.newest:
            raise RuntimeError(f"weight version {version} is not kept (newest {self.newest}, "
                               f"{self.n} copies)")
        return self.copies[version % self.n]

    def named(self, version: int) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, self.params(version)))

    def advance(self, grads: list[torch.Tensor]) -> None:
        """Version newest+1 = one optimizer step from version newest with ``grads``, written
        into the copy of version newest+1-n."""
        src = self.params(self.newest)
        dst = self.copies[(self.newest + 1) % self.n]
        with torch.no_grad():
            for d, s in zip(dst, src):
                if d is not s:
                    d.copy_(s)
        for h, d, g in zip(self.handles, dst, grads):
            h.data = d.data
            h.grad = g
        self.opt.step()
        self.newest += 1


class _RingWeights(WeightRule):
    """A weight rule over one ``VersionRing`` per stage slot."""

    accumulates_in_grad = False

    def __init__(self, slots: list[StageSlot], run_cfg, *, p: int, m: int):
        super().__init__(slots)
        self.p, self.m, self.run_cfg = p, m, run_cfg
        self.rings = {id(s): VersionRing(s, self.copies(s.stage), self.make_optimizer)
                      for s in slots}

    def copies(self, stage: int) -> int:
        raise NotImplementedError

    def make_optimizer(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        return make_optimizer(params, self.run_cfg)

    def ring(self, slot: StageSlot) -> VersionRing:
        return self.rings[id(slot)]

    def step_begin(self) -> None:
        pass  # updates follow the backwards, not the steps

    def step_end(self) -> None:
        pass

    def reported_params(self, slot):
        ring = self.ring(slot)
        return ring.params(ring.newest)

    def reported_grads(self, slot):
        return [h.grad for h in self.ring(slot).handles]


class PipeDreamWeights(_RingWeights):
    """Weight stashing: p-s versions on stage s, an optimizer step after every backward."""

    def copies(self, stage: int) -> int:
        return self.p - stage

    def loss_divisor(self, m: int) -> int:
        return 1  # every micro-batch is a minibatch of its own

    def version(self, slot: StageSlot, mb: int) -> int:
        """The updates stage s has applied when micro-batch ``mb`` (of the run) reaches it."""
        return max(0, mb - stage_delay(self.p, slot.stage))

    def forward_params(self, slot, mb):
        return self.ring(slot).named(self.version(slot, mb))

    def on_grads(self, slot, mb, params, grads) -> None:
        self.ring(slot).advance(grads)  # reported: the gradient of the latest update


class TwoBWWeights(_RingWeights):
    """Double-buffered weights: batch t runs on W(t-1); W(t+1) = opt(W(t), grad f(W(t-1)))."""

    def __init__(self, slots, run_cfg, *, p: int, m: int):
        super().__init__(slots, run_cfg, p=p, m=m)
        # one gradient buffer per stage: the .grad of the optimizer's handles
        for s in slots:
            for h in self.ring(s).handles:
                h.grad = torch.zeros_like(h)

    def copies(self, stage: int) -> int:
        return 2

    def loss_divisor(self, m: int) -> int:
        return m  # gradients accumulate over the batch, as in the synchronous schedules

    def version(self, slot: StageSlot, mb: int) -> int:
        """Batch t = mb // m runs on W(t-1)."""
        return max(0, mb // self.m - 1)

    def forward_params(self, slot, mb):
        return self.ring(slot).named(self.version(slot, mb))

    def on_grads(self, slot, mb, params, grads) -> None:
        ring = self.ring(slot)
        buffers = [h.grad for h in ring.handles]
        if mb % self.m == 0:  # the batch's first backward on this stage
            for b in buffers:
                b.zero_()
        for b, g in zip(buffers, grads):
            if g is not None:
                b.add_(g)
        if mb % self.m == self.m - 1:  # the batch's last backward: the next version
            ring.advance(buffers)
