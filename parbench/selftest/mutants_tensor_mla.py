"""Megatron 1D on multi-head latent attention (``mla-tiny``, tp=2), built wrongly:

- the shared rotary key k_R (DeepSeek-V2 Eq. 15) left out of the conjugate ``f``: it comes
  out of the duplicated kv_down, and each rank's heads add only their share to its gradient,
  so kv_down's rotary rows get partial (rank-dependent) gradients and the layer's input
  gradient misses the other ranks' heads -- the duplicated projection treated as if its
  outputs were per-head;
- the softmax scale 1 / sqrt(qk_head_dim), the rotary part's width forgotten (DeepSeek-V2
  Eq. 17 divides by sqrt(d_h + d_h^R)).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from impls.tensor.megatron import Megatron1D
from impls.tensor.megatron_model import MegatronGPT

from .catalogue import mutant, with_model

MLA = {"model": "mla-tiny", "num_microbatches": "2"}



class _RopeKeyUnreduced(MegatronGPT):
    def copy_to_heads(self, x):
        rope = self.cfg.qk_rope_head_dim
        rest, key = x.split([x.shape[-1] - rope, rope], dim=-1)
        return torch.cat([super().copy_to_heads(rest), key], dim=-1)  # the bug: k_R bypasses f


@mutant("mla-rope-key-grad-not-reduced", base="tensor.megatron", overrides=MLA,
        bug="MLA's shared rotary key outside the all-reduce of f: partial kv_down grads")
class MLARopeKeyUnreduced(with_model(Megatron1D, _RopeKeyUnreduced)):
    pass


class _ScaleWithoutRope(MegatronGPT):
    def latent_core(self, q, k, v, dims, mask=None):
        return F.scaled_dot_product_attention(  # the bug: 1/sqrt(d), not 1/sqrt(d + d_R)
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=1 / math.sqrt(dims.qk))


@mutant("mla-softmax-scale-without-rope-dim", base="tensor.megatron", overrides=MLA,
        bug="MLA's softmax scale 1/sqrt(qk_head_dim), the rotary width left out")
class MLAScaleWithoutRope(with_model(Megatron1D, _ScaleWithoutRope)):
    pass
