"""Realistic bugs in DistFlashAttn (``context.distflashattn``; see mutants_context): the
helper's partial result merged without its log-sum-exp, a helped block computed twice, a
causal mask on a helped block, a rematerialised layer whose checkpoint hands backward a
stale attention output, and one whose backward recomputation rotates q and k at the chunk's
local positions (the position ids not handed to the recomputation, on the LLaMA blocks).
Each needs cp = 4 (at cp = 2 nobody helps)."""
from __future__ import annotations

import torch

from impls.context.distflash import DistFlashAttnScheme
from impls.context.distflash_attn import DistFlashCore, DistFlashPeers
from impls.context.distflash_plan import BalancedSchedule
from impls.context.distflash_remat import RematLayer
from impls.context.shard import shard_forward

from .catalogue import mutant
from .mutants_context_llama import ROPE, _with_positions


class _UnscaledHelperPeers(DistFlashPeers):
    def merge_remote(self, out, lse, blk_out, blk_lse):
        new = torch.logaddexp(lse, blk_lse)
        out.mul_(torch.exp(lse - new).unsqueeze(-1))
        out.add_(blk_out)  # the bug: the helper's rows are not weighted by exp(lse_h - lse)
        lse.copy_(new)


@mutant("dfa-helper-no-rescale", base="context.distflashattn", overrides={"cp": "4"},
        bug="the helper's partial output is added without rescaling by its log-sum-exp")
class DFAHelperNoRescale(DistFlashAttnScheme):
    peers_class = _UnscaledHelperPeers


class _OddHelpingSchedule(BalancedSchedule):
    def helping_steps(self):
        return self.P // 2  # the bug: P // 2 helping steps for even P too (right for odd P)


@mutant("dfa-help-double-count", base="context.distflashattn", overrides={"cp": "4"},
        bug="even cp: idle workers also help in the last step, computing blocks their owners "
            "compute themselves (counted twice)")
class DFAHelpDoubleCount(DistFlashAttnScheme):
    schedule_class = _OddHelpingSchedule


class _CausalHelperPeers(DistFlashPeers):
    helped_causal = True  # the bug: the diagonal's mask (local offsets) on a helped block


@mutant("dfa-helper-causal-mask", base="context.distflashattn", overrides={"cp": "4"},
        bug="the helper masks the busy worker's queries causally on local offsets, as if the "
            "helped block were a diagonal one")
class DFAHelperCausalMask(DistFlashAttnScheme):
    peers_class = _CausalHelperPeers


class _StaleCheckpointCore(DistFlashCore):
    def __init__(self, peers):
        super().__init__(peers)
        self.buffer = {}

    def keep(self, blk, x, out, lse):
        self.buffer.setdefault(id(blk), (out, lse))  # the bug: filled once, never refreshed
        return (x,)

    def kept(self, blk, saved):
        return (saved[0], *self.buffer[id(blk)])


@mutant("dfa-remat-stale-checkpoint", base="context.distflashattn",
        overrides={"cp": "4", "recompute": "full", "num_microbatches": "2"},
        bug="rematerialised layers read the attention output and log-sum-exp from a per-layer "
            "buffer filled by the first micro-batch only (stale in backward)")
class DFARematStaleCheckpoint(DistFlashAttnScheme):
    core_class = _StaleCheckpointCore


class _LocalPositionsRemat(RematLayer):
    @staticmethod
    def backward(ctx, dy):
        if ctx.docs is not None:  # the bug: the recomputation rotates at 0..n-1
            n = ctx.docs.pos.shape[1]
            ctx.docs = _with_positions(ctx.docs, torch.arange(n))
        return RematLayer.backward(ctx, dy)


def _local_positions_layer(blk, x, core, recompute="full", docs=None, taps=None,
                           name="blocks.0"):
    return _LocalPositionsRemat.apply(x, blk, core, taps, name, docs)


@mutant("dfa-remat-rope-local-positions", base="context.distflashattn",
        overrides={**ROPE, "cp": "4", "recompute": "full"},
        bug="the rematerialised layer's backward recomputes q and k with RoPE at the chunk's "
            "local positions (its position ids not passed to the recomputation)")
class DFARematRopeLocalPositions(DistFlashAttnScheme):
    model_features = DistFlashAttnScheme.model_features

    def forward(self, tokens, targets, pos, measure=False):
        if self.ctx.options.recompute != "full":
            return super().forward(tokens, targets, pos, measure)
        return shard_forward(self.model, tokens, pos, targets, self.core, "full", None,
                             self.embed, self.loss_fn(), self.docs, self.taps,
                             layer_fn=_local_positions_layer)
