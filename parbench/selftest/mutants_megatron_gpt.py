"""Megatron-Core's GPTModel (``baseline.megatron.gpt``) loaded with a wrong weight mapping --
the two classic bugs of converting a LLaMA checkpoint to Megatron-Core's layout:

- ``linear_qkv`` filled as plain [Q; K; V] rows (each rank: its query heads, then its K
  heads, then its V heads) instead of Megatron-Core's group-interleaved order [q of group 0,
  k0, v0, q of group 1, ...] (Megatron-Core docs, ``SelfAttention``: the fused QKV is split
  per query group). With one query group per rank both orders coincide, so the case gives
  each tp rank two groups (MHA, num_kv_heads = num_heads = 4, tp = 2);
- SwiGLU's ``linear_fc1`` filled as [up; gate] instead of [gate; up] (Megatron-Core's
  ``glu``: the first half goes through the activation; Shazeer 2020, "GLU Variants Improve
  Transformer", Eq. 5 gates with the activated half).

Both mutants need megatron-core: where it is not installed their scheme reports itself
unavailable and ``parbench selftest`` skips them, saying why.
"""
from __future__ import annotations

import torch

from impls.baselines.megatron_gpt import (GPTModelLayout, MegatronCoreGPTModel,
                                          MegatronCoreGPTScheme)
from impls.tensor.megatron_model import MegatronLayout
from impls.tensor.shards import blocks

from .catalogue import mutant, with_model

LLAMA = {"model": "llama-tiny", "vocab_size": "128"}


class _PlainQKVLayout(GPTModelLayout):
    qkv_rows = MegatronLayout.qkv_rows  # the bug: [Q_r; K_r; V_r], not group-interleaved


class _PlainQKV(MegatronCoreGPTModel):
    layout_cls = _PlainQKVLayout


@mutant("mcore-gpt-qkv-plain-order", base="baseline.megatron.gpt",
        overrides={**LLAMA, "num_kv_heads": "4"},
        bug="linear_qkv loaded as plain [Q; K; V] rows, not Megatron's group-interleaved order")
class MCoreGPTQKVPlain(with_model(MegatronCoreGPTScheme, _PlainQKV)):
    pass


class _SwappedFc1Layout(GPTModelLayout):
    def fc1_rows(self, r: int) -> torch.Tensor:
        f, w = self.cfg.ffn, self.cfg.ffn // self.tp
        return torch.cat([blocks(f + r * w, w), blocks(r * w, w)])  # the bug: [up; gate]


class _SwappedFc1(MegatronCoreGPTModel):
    layout_cls = _SwappedFc1Layout


@mutant("mcore-gpt-fc1-halves-swapped", base="baseline.megatron.gpt", overrides=LLAMA,
        bug="SwiGLU linear_fc1 loaded as [up; gate] instead of Megatron's [gate; up]")
class MCoreGPTFc1Swapped(with_model(MegatronCoreGPTScheme, _SwappedFc1)):
    pass
