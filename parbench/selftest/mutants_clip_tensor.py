"""Gradient clipping by global norm (``clip_grad``; issue 20, sec. 3) in the tensor- and
context-parallel families: the bugs real trainers have had in it. Each runs its family's
small case (``FAMILY_CASES``) with ``clip_grad=0.5``, below the tiny model's gradient norm
(about 1.0), so every checked step clips; the schemes report the clipped gradients, so a
wrong norm shows at the golden check as gradients off by the ratio of the two factors.

- the parameters replicated over tp (LayerNorms, row-parallel biases, the position
  embedding) counted on every tp rank: the squared norm over-counts them t times -- the bug
  Megatron-LM's ``param_is_not_tensor_parallel_duplicate`` filter in ``clip_grad_norm_fp32``
  exists to prevent;
- the squared norm of the rank's own shards, never all-reduced over tp (each rank clips by
  its own, different factor);
- sequence parallelism: the norm taken before the LayerNorm / bias gradients, partial sums
  along the sequence, are all-reduced over tp;
- context parallelism: each rank clips its own gradient before the all-reduce over cp
  (the norm of one sequence shard's gradient, not of the averaged one).
"""
from __future__ import annotations

from impls.common.clip import clip_grads_
from impls.context.schemes import RingAttentionScheme
from impls.tensor.megatron import Megatron1D, MegatronSP

from .catalogue import mutant
from .mutants_clip import CLIP


@mutant("tp-clip-replicated-counted-twice", base="tensor.megatron", overrides=CLIP,
        bug="the clipping norm counts the tp-replicated parameters (LayerNorms, row biases, "
            "positions) on every tp rank (no duplicate filter)")
class TPClipReplicatedCountedTwice(Megatron1D):
    def norm_params(self):
        return list(self.params)


@mutant("tp-clip-local-norm", base="tensor.megatron", overrides=CLIP,
        bug="the clipping norm of the rank's own shards (no all-reduce over tp)")
class TPClipLocalNorm(Megatron1D):
    def norm_groups(self):
        return []


@mutant("sp-clip-before-ln-reduce", base="tensor.megatron-sp", overrides=CLIP,
        bug="sequence parallelism: the gradients are clipped before the LayerNorm / bias "
            "partial gradients are all-reduced over tp")
class SPClipBeforeLayerNormReduce(MegatronSP):
    def after_backward(self):
        Megatron1D.clip(self)
        super().after_backward()

    def clip(self):
        pass


@mutant("cp-clip-before-grad-allreduce", base="context.ring-attention", overrides=CLIP,
        bug="each cp rank clips its own gradient by its own norm before the all-reduce over "
            "cp (not the averaged gradient)")
class CPClipBeforeGradAllReduce(RingAttentionScheme):
    def reduce_gradients(self):
        clip_grads_([p.grad for p in self.params], self.ctx.run.clip_grad)
        super().reduce_gradients()

    def clip(self):
        pass
