"""A masked loss (``loss_mask``; issue 20, sec. 3) normalised wrongly: the bugs trainers have
had when the counted tokens differ between micro-batches and ranks (prompt masking, padding).
The golden loss is the mean over the global batch's counted tokens (Megatron-LM's
--calculate-per-token-loss).

- each micro-batch's mean loss averaged over the micro-batches (1/m), which weights a token
  of a short micro-batch more: the gradient-accumulation normalisation bug that
  Hugging Face transformers fixed in 2024 and that Megatron's per-token loss exists for;
- each rank's loss normalised by its own counted tokens, not the global count (the token
  count not all-reduced over data parallelism).
"""
from __future__ import annotations

from parbench.model import counted_tokens

from impls.data.ddp import NativeDDP
from impls.zero.replicated import Zero2

from .catalogue import mutant

#: prompts of up to 60% of a sample masked, over 2 micro-batches: counts differ per
#: micro-batch and rank on every step of the small case
MASK = {"loss_mask": "0.6", "num_microbatches": "2"}


@mutant("ddp-loss-mean-per-microbatch", base="data.ddp", overrides=MASK,
        bug="each micro-batch's mean loss scaled by 1/m, not by its share of the global "
            "batch's counted tokens")
class DDPLossMeanPerMicrobatch(NativeDDP):
    def loss_scale(self, ym):
        return 1.0 / self.ctx.layout.num_microbatches


@mutant("zero2-loss-local-token-count", base="zero.2", overrides=MASK,
        bug="the loss normalised by the rank's own counted tokens, not the global count")
class Zero2LossLocalTokenCount(Zero2):
    def local_microbatches(self, inputs, targets):
        mbs = super().local_microbatches(inputs, targets)
        self.global_tokens = sum(counted_tokens(y) for _, y in mbs) * self.dp_size
        return mbs
