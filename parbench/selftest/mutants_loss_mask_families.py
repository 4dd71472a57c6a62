"""A masked loss (``loss_mask``; issue 20, sec. 3) normalised wrongly in the tensor, context
and expert families (see mutants_loss_mask for the data family's). The golden loss is the mean
over the global batch's counted tokens (Megatron-LM's --calculate-per-token-loss); each
mutant is a bug a trainer has when it passes the mask through a parallel loss:

- tensor: the vocab-parallel cross-entropy, which has no ignore_index, averaged over every
  token (a masked target's log-sum of exponentials counted, and in the denominator); a grid
  rank's batch block normalised by its own counted tokens (the count not all-reduced over the
  blocks);
- context: each cp rank's loss the mean over its own shard's counted tokens (the count not
  all-reduced over cp): a token of a shard with more prompt weighs more;
- expert: each micro-batch's mean loss scaled by 1/m, not by its share of the global count.
"""
from __future__ import annotations

from parbench.model import counted_tokens

from impls.context.schemes import RingAttentionScheme
from impls.context.shard import mean_loss
from impls.expert.scheme import ExpertAllToAll
from impls.tensor.megatron import Megatron1D
from impls.tensor.megatron_model import MegatronGPT
from impls.tensor.summa import Optimus, SummaGPT

from .catalogue import mutant, with_model

#: prompts of up to 60% of a sample masked, over 2 micro-batches: counts differ per
#: micro-batch, sample and shard on every step of the small cases
MASK = {"loss_mask": "0.6", "num_microbatches": "2"}



# ---- tensor ------------------------------------------------------------------------------------


class _EveryTokenMean(MegatronGPT):
    @staticmethod
    def token_mean(loss, target):
        return loss.mean()  # the bug: the masked tokens' losses kept, and counted


@mutant("tp-ce-masked-tokens-counted", base="tensor.megatron", overrides=MASK,
        bug="the vocab-parallel cross-entropy averaged over every token: a masked target's "
            "loss (its log-sum of exponentials) kept and counted in the denominator")
class TPMaskedTokensCounted(with_model(Megatron1D, _EveryTokenMean)):
    pass


class _BlockTokenCount(SummaGPT):
    def token_count(self, targets):
        rows = self.rows(targets.shape[0])
        blocks = targets.shape[0] // (rows.stop - rows.start)
        # the bug: the block's own count (times the blocks), not the micro-batch's
        return counted_tokens(targets[rows]) * blocks


@mutant("2d-loss-block-token-count", base="tensor.2d", overrides={"tp": "4", **MASK},
        bug="each batch block's summed loss divided by its own counted tokens (times the "
            "blocks), not by the micro-batch's: the blocks' means averaged")
class SummaLossBlockTokenCount(with_model(Optimus, _BlockTokenCount)):
    pass


# ---- context -----------------------------------------------------------------------------------


@mutant("cp-loss-shard-token-mean", base="context.ring-attention",
        overrides={"cp_balance": "zigzag", **MASK},
        bug="each cp rank's loss the mean over its own shard's counted tokens / m, not its "
            "sum over the global batch's count: the shards' means averaged")
class CPLossShardTokenMean(RingAttentionScheme):
    def loss_scale(self, m):
        return 1.0 / m

    def loss_fn(self):
        return mean_loss


# ---- expert ------------------------------------------------------------------------------------


@mutant("ep-loss-mean-per-microbatch", base="expert.alltoall", overrides=MASK,
        bug="each micro-batch's mean loss scaled by 1/m, not by its share of the global "
            "batch's counted tokens")
class EPLossMeanPerMicrobatch(ExpertAllToAll):
    def loss_scale(self, ym):
        return 1.0 / self.ctx.layout.num_microbatches
