"""Gradient clipping by global norm (``clip_grad``; issue 20, sec. 3): the bugs real trainers
have had in it. Each runs its family's small case with a threshold the reference norm exceeds
(about 1.0 at initialisation on the tiny model, so ``clip_grad=0.5`` clips every checked step;
the row records ``clipped_steps``), and the scheme reports the clipped gradients, so a wrong
norm shows as gradients off by the ratio of the factors, at the golden check.

- the norm of the rank's own shard, not of the whole gradient: ZeRO / FSDP / Megatron's
  distributed optimizer summing squares over the local partition only (the all-reduce over
  the data-parallel group left out);
- the norm taken before the gradients are averaged over data parallelism (of the dp-fold sum,
  so the clip acts d times too hard);
- each tensor clipped by its own norm (``clip_grad_norm_`` called in a loop over the
  parameters instead of once on all of them).
"""
from __future__ import annotations

from impls.common.clip import clip_grads_
from impls.data.ddp import NativeDDP
from impls.zero.replicated import Zero1, Zero2

from .catalogue import mutant

#: a threshold below the tiny model's gradient norm (about 1.0), so every checked step clips
CLIP = {"clip_grad": "0.5"}


@mutant("zero2-clip-local-norm", base="zero.2", overrides=CLIP,
        bug="the clipping norm of the rank's own gradient shard (no all-reduce over dp)")
class Zero2ClipLocalNorm(Zero2):
    def clip(self):
        clip_grads_([m.grad for m in self.masters], self.ctx.run.clip_grad)


@mutant("zero1-clip-before-average", base="zero.1", overrides=CLIP,
        bug="the gradients are clipped before they are divided by dp (the norm of the sum)")
class Zero1ClipBeforeAverage(Zero1):
    def step_masters(self):
        for m, g in zip(self.masters, self.gshard):
            m.grad = g
        clip_grads_(self.gshard, self.ctx.run.clip_grad, groups=[self.group])
        self.clip = lambda: None
        super().step_masters()


@mutant("ddp-clip-per-tensor", base="data.ddp", overrides=CLIP,
        bug="each gradient tensor is clipped by its own norm, not by the global one")
class DDPClipPerTensor(NativeDDP):
    def clip(self):
        for p in self.params:
            clip_grads_([p.grad], self.ctx.run.clip_grad)
