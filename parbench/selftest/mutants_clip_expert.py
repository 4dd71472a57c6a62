"""Gradient clipping by global norm (``clip_grad``; issue 20, sec. 3) in the expert family and
the hybrid: the ways real trainers have counted a sharded or replicated gradient wrongly in
the norm. Each runs its family's small case with ``clip_grad=0.5`` (below the tiny MoE
model's gradient norm, so every checked step clips; the row records ``clipped_steps``); the
scheme reports the gradients it stepped on, so a wrong norm shows at the golden check as
gradients off by the ratio of the two clip factors.

- the experts' squares of the rank's own experts only, never summed over ep: the norm
  misses the other ranks' experts (Megatron-Core MoE has had its expert grad norm computed on
  the local experts only);
- the whole squared norm summed over the ep group, so the dense parameters, which every ep
  rank holds whole, are counted ep times;
- FasterMoE: the shadow experts' gradients (copies that live for one step) counted in the
  norm beside their owners' (a norm over every tensor that took a gradient);
- the hybrid with ZeRO-1 (Megatron's distributed optimizer): the squares of the rank's own
  slice of the flat buffers, never summed over dp x cp (dense) and edp (experts);
- the hybrid under tp: the tp-replicated parameters (LayerNorms, row-parallel biases, the
  position embedding, the routers) counted on every tp rank, not only on tp rank 0 (what
  Megatron's ``param_is_not_tensor_parallel_duplicate`` guards against).
"""
from __future__ import annotations

from impls.expert.clip import expert_parallel_norm, summed_sq
from impls.expert.scheme import ExpertAllToAll
from impls.expert.shadow import ExpertFasterMoE
from impls.hybrid.clip import counted_params
from impls.hybrid.scheme import HybridScheme

from .catalogue import mutant
from .mutants_clip import CLIP


@mutant("ep-clip-expert-norm-local", base="expert.alltoall", overrides=CLIP,
        bug="the clipping norm counts only the rank's own experts (their squares are not "
            "summed over ep)")
class ExpertClipLocalExperts(ExpertAllToAll):
    def grad_norm(self):
        return expert_parallel_norm([self.dense.buffer], [self.experts.buffer], None)


@mutant("ep-clip-dense-counted-ep-times", base="expert.alltoall", overrides=CLIP,
        bug="the whole squared norm is summed over the ep group, so the dense gradients, "
            "whole on every ep rank, are counted ep times")
class ExpertClipDenseOverEp(ExpertAllToAll):
    def grad_norm(self):
        sq = summed_sq([self.dense.buffer, self.experts.buffer], [self.ctx.mesh.group("ep")])
        return float(sq.sqrt())


@mutant("fastermoe-clip-counts-shadows", base="expert.fastermoe",
        overrides={**CLIP, "moe_capacity_factor": "0", "moe_shadow": "1"},
        bug="the shadow experts' gradients are counted in the clipping norm beside their "
            "owner's (a norm over every tensor that took a gradient, copies included)")
class FasterMoEClipCountsShadows(ExpertFasterMoE):
    def reduce_expert_gradients(self):
        self.copies = [leaf.grad.detach() / self.dp for _, leaf, _ in self.dispatch.pending
                       if leaf.grad is not None]
        super().reduce_expert_gradients()

    def grad_norm(self):
        copies, self.copies = self.copies, []  # nothing kept between steps
        return expert_parallel_norm([self.dense.buffer], [self.experts.buffer] + copies,
                                    self.ctx.mesh.group("ep"))


@mutant("hybrid-clip-zero-shard-local", base="hybrid", overrides={**CLIP, "zero_stage": "1"},
        bug="with the distributed optimizer the clipping norm is that of the rank's own "
            "shard of the flat gradient buffers (no sum over dp x cp, nor over edp)")
class HybridClipShardLocal(HybridScheme):
    def clip_axes(self):
        return ["tp"], ["ep"] if self.ctx.model.num_experts else []


@mutant("hybrid-clip-tp-duplicates", base="hybrid", overrides=CLIP,
        bug="the tp-replicated parameters (LayerNorms, row-parallel biases, routers) are "
            "counted in the clipping norm on every tp rank")
class HybridClipTpDuplicates(HybridScheme):
    def clip_counted(self):
        return counted_params(self.slots, 0, self.peer is not None)
