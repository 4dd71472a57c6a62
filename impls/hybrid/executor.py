"""The pipeline executor of the hybrid (``impls.pipeline.executor``) with its masked-loss
normalisation.

With ``loss_mask`` each last stage returns the sum of its counted tokens' losses over its cp
shard of its dp rows of one micro-batch (``model.HybridStage.summed_loss``); the executor
multiplies it by dp cp / N, N the global batch's counted tokens, which every rank knows (it
holds the global batch, so the count needs no collective). After the dense gradients'
all-reduce over dp x cp and its 1/(dp cp), and the experts' sum over edp and 1/(dp cp), the
step's gradient is that of the mean over the global batch's counted tokens -- Megatron-LM's
--calculate-per-token-loss, which all-reduces the count over dp x cp and sums the
micro-batches' token losses. A shard of prompt tokens only adds 0 (its mean would be 0/0).
"""
from __future__ import annotations

import torch

from impls.pipeline.executor import Executor


class HybridExecutor(Executor):
    """``Executor`` whose masked-loss scale is dp cp / N (``token_sets`` = dp cp)."""

    def __init__(self, *, token_sets: int, **kwargs):
        super().__init__(**kwargs)
        self.token_sets = token_sets

    def loss_scale(self, mb: int, y: torch.Tensor) -> float:
        """1/m unmasked; with a loss mask (``global_tokens`` set) dp cp / N of the stage's
        summed token losses."""
        if self.global_tokens is None:
            return super().loss_scale(mb, y)
        return self.token_sets / self.global_tokens
