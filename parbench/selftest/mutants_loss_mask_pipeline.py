"""A masked loss (``loss_mask``) normalised wrongly in the native pipeline schedules. The
golden loss is the mean over the global batch's counted tokens (Megatron-LM's
--calculate-per-token-loss); the last stage must scale micro-batch loss by n_mb / N.

- each micro-batch's mean loss scaled by 1/m on the last stage: the gradient-accumulation
  normalisation bug, which weights a token of a short micro-batch more.
"""
from __future__ import annotations

from impls.pipeline import SCHEMES
from impls.pipeline.executor import Executor

from .catalogue import mutant

#: prompts of up to 60% of a sample masked over 4 micro-batches: counts differ per micro-batch
MASK = {"loss_mask": "0.6", "num_microbatches": "4"}


class _MeanPerMicrobatch(Executor):
    def loss_scale(self, mb, y):
        return 1.0 / self.m


@mutant("1f1b-loss-mean-per-microbatch", base="pipeline.1f1b", overrides=MASK,
        bug="the last stage scales each micro-batch's mean loss by 1/m, not by its share "
            "of the global batch's counted tokens")
class OneFOneBLossMeanPerMicrobatch(SCHEMES["1f1b"]):
    executor_class = _MeanPerMicrobatch
