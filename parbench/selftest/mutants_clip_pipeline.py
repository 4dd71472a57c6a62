"""Gradient clipping by global norm on the pipeline family (``clip_grad``; issue 20, sec. 3):
the ways a pipeline trainer gets the norm of a model it holds in pieces wrong. They run on
``FAMILY_CASES["pipeline"]`` (tiny-4l, pp=2, m=4) with ``clip_grad=0.5``, below the tiny
model's gradient norm (about 1.0), so every checked step clips; the scheme reports the
gradients it stepped on, so a wrong norm shows as every gradient off by the ratio of the two
clip factors at the golden check.

- each stage clips by the norm of its own stage (the squared norm never all-reduced over the
  pipeline group: Megatron-LM's ``clip_grad_norm_fp32`` reduces it over the model-parallel
  group, which includes pp, because a stage-local norm is wrong);
- the tied word embedding counted on both the first and the last stage (its two copies hold
  the same summed gradient, so it enters the norm twice; Megatron-LM filters the shared
  embedding out of the last stage's squares);
- a bidirectional schedule counting each stage twice: DualPipe adding the squares of both
  replicas of every stage after their exchange (both hold the whole gradient), and Chimera
  clipping before the exchange, on the norm of the two replicas' partial gradients (the sum
  of their squares is not the square of their sum).
"""
from __future__ import annotations

from impls.common.clip import clip_grads_
from impls.pipeline import SCHEMES

from .catalogue import mutant
from .mutants_clip import CLIP


def _all_grads(scheme) -> list:
    """Every gradient the rank steps on (both replicas, both tied copies)."""
    return [p.grad for s in scheme.slots.values() for p in s.params]


@mutant("1f1b-clip-stage-norm", base="pipeline.1f1b", overrides=CLIP,
        bug="each stage clips by its own stage's gradient norm (no all-reduce over pp)")
class OneFOneBClipStageNorm(SCHEMES["1f1b"]):
    def clip(self):
        clip_grads_(_all_grads(self), self.ctx.run.clip_grad, owned=self.norm_owned())


@mutant("1f1b-clip-tied-counted-twice", base="pipeline.1f1b",
        overrides={**CLIP, "tie_embeddings": "true"},
        bug="the tied word embedding's gradient enters the norm on both the first and the "
            "last stage (no shared-embedding filter)")
class OneFOneBClipTiedTwice(SCHEMES["1f1b"]):
    def norm_owned(self):
        return _all_grads(self)


@mutant("dualpipe-clip-both-replicas", base="pipeline.dualpipe", overrides=CLIP,
        bug="both replicas of every stage enter the norm after the gradient exchange (each "
            "stage counted twice)")
class DualPipeClipBothReplicas(SCHEMES["dualpipe"]):
    def norm_owned(self):
        return _all_grads(self)


@mutant("chimera-clip-before-exchange", base="pipeline.chimera", overrides=CLIP,
        bug="the gradients are clipped before the two replicas add them, by the norm of "
            "the replicas' partial gradients")
class ChimeraClipBeforeExchange(SCHEMES["chimera"]):
    def _sync_replicas(self):
        clip_grads_(_all_grads(self), self.ctx.run.clip_grad, groups=[self.group])
        super()._sync_replicas()

    def clip(self):
        pass  # already clipped, before the exchange
