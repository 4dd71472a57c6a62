"""Realistic bugs in the pipeline family: each mutant is a subclass of a native pipeline scheme
(or of its weight rule or executor) with one thing changed, registered as a scheme of its own
(``mutant.<id>``; see ``mutants_data``). They run on ``FAMILY_CASES["pipeline"]`` (tiny-4l,
pp=2, m=4); the asynchronous ones add one timed step, which their continuous pipeline needs
to drain outside the checked steps, and the tied-embedding ones set ``tie_embeddings``.
"""
from __future__ import annotations

import torch

from impls.pipeline import SCHEMES
from impls.pipeline.async_weights import PipeDreamWeights, TwoBWWeights
from impls.pipeline.executor import Executor
from impls.pipeline.weights import SyncWeights

from .catalogue import mutant
from .optimizers import make_buggy_optimizer

ASYNC = {"timed_steps": "1"}


def _weights(cls, rule):
    """The scheme's ``make_weights`` with ``rule`` (a weight-rule class) instead."""
    def make_weights(self):
        return rule(list(self.slots.values()), self.ctx.run)
    return type(cls.__name__, (cls,), {"make_weights": make_weights})


# ---- optimizer bugs (the update check) ------------------------------------------------------

class _NoWeightDecay(SyncWeights):
    def make_optimizer(self, params):
        return make_buggy_optimizer(params, self.run_cfg, "no-wd")


class _NoBiasCorrection(SyncWeights):
    def make_optimizer(self, params):
        return make_buggy_optimizer(params, self.run_cfg, "no-bias-correction")


@mutant("1f1b-no-wd", base="pipeline.1f1b", bug="weight decay dropped on the stages")
class OneFOneBNoWeightDecay(_weights(SCHEMES["1f1b"], _NoWeightDecay)):
    pass


@mutant("1f1b-bias-correction-off", base="pipeline.1f1b",
        bug="AdamW without bias correction on the stages")
class OneFOneBNoBiasCorrection(_weights(SCHEMES["1f1b"], _NoBiasCorrection)):
    pass


# ---- gradient accumulation over micro-batches ------------------------------------------------

class _Unscaled(SyncWeights):
    def loss_divisor(self, m: int) -> int:
        return 1  # the bug: each micro-batch loss is not divided by m


@mutant("1f1b-unscaled-loss", base="pipeline.1f1b",
        bug="each micro-batch's loss is not scaled by 1/m before its backward")
class OneFOneBUnscaledLoss(_weights(SCHEMES["1f1b"], _Unscaled)):
    pass


class _Overwrite(SyncWeights):
    accumulates_in_grad = False  # gradients come back through on_grads

    def on_grads(self, slot, mb, params, grads) -> None:
        for p, g in zip(params, grads):
            if g is not None:
                p.grad.copy_(g)  # the bug: copied, not added


@mutant("gpipe-overwrite-accumulation", base="pipeline.gpipe",
        bug="p.grad is overwritten, not accumulated, by every micro-batch's backward")
class GPipeOverwrite(_weights(SCHEMES["gpipe"], _Overwrite)):
    pass


class _SkipOneW(Executor):
    def _backward_weight(self, slot, a) -> None:
        if a.mb == self.m - 1 and a.stage > 0:
            self.saved.pop((a.mb, a.stage, a.pipe))  # the bug: its W never runs
            return
        super()._backward_weight(slot, a)


@mutant("zbh1-skip-w", base="pipeline.zb-h1",
        bug="the last micro-batch's W is dropped on the later stages (its graph is freed "
            "without the weight gradients)")
class ZBH1SkipW(SCHEMES["zb-h1"]):
    executor_class = _SkipOneW


# ---- stale weights -------------------------------------------------------------------------

class _StaleForward(SyncWeights):
    """Forwards run on the weights of the step before (a copy taken before each update)."""

    accumulates_in_grad = False

    def __init__(self, slots, run_cfg):
        super().__init__(slots, run_cfg)
        self.previous = {id(s): self._copy(s) for s in slots}

    @staticmethod
    def _copy(slot):
        return {n: torch.nn.Parameter(p.detach().clone()) for n, p in zip(slot.names,
                                                                        slot.params)}

    def forward_params(self, slot, mb):
        return self.previous[id(slot)]

    def on_grads(self, slot, mb, params, grads) -> None:
        for p, g in zip(slot.params, grads):
            if g is not None:
                p.grad.add_(g)

    def step_end(self) -> None:
        self.previous = {id(s): self._copy(s) for s in self.slots}
        super().step_end()


@mutant("1f1b-stale-weights", base="pipeline.1f1b",
        bug="forwards run on the previous step's weights (a copy refreshed before, not "
            "after, the optimizer step)")
class OneFOneBStaleWeights(_weights(SCHEMES["1f1b"], _StaleForward)):
    pass


# ---- two replicas ----------------------------------------------------------------------------

@mutant("dualpipe-average-sync", base="pipeline.dualpipe",
        bug="the two replicas' gradients are averaged instead of summed")
class DualPipeAverageSync(SCHEMES["dualpipe"]):
    def _sync_replicas(self):
        super()._sync_replicas()
        for slot in self._replica_slots():
            for p in slot.params:
                p.grad.mul_(0.5)  # the bug: each replica saw half the micro-batches


# ---- tied embeddings --------------------------------------------------------------------------

TIED = {"tie_embeddings": "true"}


@mutant("1f1b-tied-unsynced", base="pipeline.1f1b", overrides=TIED,
        bug="the tied word embedding's gradients are not summed over the embedding group: "
            "the first stage's embedding and the last stage's output layer step apart")
class OneFOneBTiedUnsynced(SCHEMES["1f1b"]):
    def _sync_tied(self):
        pass  # the bug: Megatron's _allreduce_word_embedding_grads left out


@mutant("1f1b-tied-one-way", base="pipeline.1f1b", overrides=TIED,
        bug="the tied embedding's gradients are reduced onto the first stage only: the last "
            "stage's copy keeps its own output-layer gradient")
class OneFOneBTiedOneWay(SCHEMES["1f1b"]):
    def _sync_tied(self):
        tied = self.tied
        if tied.remote:
            (w,) = tied.copies()
            first = self.group_ranks[0]
            # the bug: a reduce onto the embedding's rank where an all-reduce belongs
            torch.distributed.reduce(w.grad, dst=first, group=tied.group)


# ---- the asynchronous rules ------------------------------------------------------------------

class _TwoBWNoDelay(TwoBWWeights):
    def version(self, slot, mb):
        return self.ring(slot).newest  # the bug: the newest weights, not W(t-1)


@mutant("2bw-no-delay", base="pipeline.2bw", overrides=ASYNC,
        bug="micro-batches run on the newest weights instead of the one-step-old version "
            "(the delay of W(t+1) = W(t) - lr grad f(W(t-1)) dropped)")
class TwoBWNoDelay(SCHEMES["2bw"]):
    def make_weights(self):
        return _TwoBWNoDelay(list(self.slots.values()), self.ctx.run, p=self.schedule.p,
                             m=self.m)


class _StashOffByOne(PipeDreamWeights):
    """The stage delay counted as p-s instead of p-1-s, consistently: one version more
    stashed, and every forward one update further behind."""

    def copies(self, stage: int) -> int:
        return self.p - stage + 1

    def version(self, slot, mb):
        return max(0, mb - (self.p - slot.stage))


@mutant("pipedream-stash-off-by-one", base="pipeline.pipedream", overrides=ASYNC,
        bug="the weight-stashing delay is off by one (p-s instead of p-1-s)")
class PipeDreamStashOffByOne(SCHEMES["pipedream"]):
    def make_weights(self):
        return _StashOffByOne(list(self.slots.values()), self.ctx.run, p=self.schedule.p,
                              m=self.m)
