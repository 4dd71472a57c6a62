"""Megatron 1D on the LLaMA blocks and packed sequences, built wrongly (``llama-tiny``, tp=2):

- SwiGLU's fused fc1 [gate; up] sharded as contiguous row blocks, so rank 0 holds the whole
  gate and rank 1 the whole up projection -- the classic bug of splitting Megatron-Core's
  linear_fc1 like a plain column-parallel linear (it must take each half's rows per rank);
- under sequence parallelism with packed documents (GPT-2 blocks), the learned position
  embedding at the rank's rows of the global positions instead of the within-document ones
  (--reset-position-ids forgotten). Its RoPE analogue is no bug: with the document mask
  every score pairs a query and a key of one document, and rotary scores depend on m - n
  only (Su et al. 2021, Eq. 16), so global positions give the same attention up to rounding;
- grouped-query attention's K/V heads of the wrong tp rank: rank r takes query group r + 1
  (mod t), the off-by-one between the tp rank and the query-group rank;
- with packed documents and selective recompute, the attention core recomputed in backward
  without the documents' mask (causal only): forward and backward disagree.
"""
from __future__ import annotations

import torch

from impls.tensor.layers import Recompute
from impls.tensor.megatron import Megatron1D, MegatronSP
from impls.tensor.megatron_model import MegatronGPT, MegatronLayout
from impls.tensor.shards import blocks

from .catalogue import mutant, with_model

LLAMA = {"model": "llama-tiny", "num_microbatches": "2"}



class _ContiguousFc1Layout(MegatronLayout):
    def fc1_rows(self, r):
        w = 2 * self.cfg.ffn // self.tp
        return blocks(r * w, w)  # the bug: a contiguous 1/t of [gate; up]


class _ContiguousFc1(MegatronGPT):
    layout_cls = _ContiguousFc1Layout


@mutant("tp-swiglu-fc1-contiguous", base="tensor.megatron", overrides=LLAMA,
        bug="SwiGLU's fc1 [gate; up] split into contiguous row blocks (rank 0 all gate)")
class TPSwiGLUContiguous(with_model(Megatron1D, _ContiguousFc1)):
    pass


class _GlobalPositions(MegatronGPT):
    def embed(self, tokens, docs=None):
        return super().embed(tokens, None)  # the bug: the rank's rows of arange(s)


@mutant("sp-packed-global-positions", base="tensor.megatron-sp",
        overrides={"num_microbatches": "2", "pack_docs": "3"},
        bug="learned positions global, not within-document, with packed sequences under sp")
class SPPackedGlobalPositions(with_model(MegatronSP, _GlobalPositions)):
    pass


class _NextGroupLayout(MegatronLayout):
    def qkv_rows(self, r):
        rows = super().qkv_rows(r)
        q = self.cfg.num_heads * self.cfg.head_dim // self.tp
        other = super().qkv_rows((r + 1) % self.tp)
        return torch.cat([rows[:q], other[q:]])  # the bug: K/V of the next query group


class _NextGroup(MegatronGPT):
    layout_cls = _NextGroupLayout


@mutant("tp-gqa-kv-heads-next-rank", base="tensor.megatron", overrides=LLAMA,
        bug="GQA K/V heads of query group r+1 on tp rank r")
class TPGQANextGroup(with_model(Megatron1D, _NextGroup)):
    pass


class _MasklessRecompute(MegatronGPT):
    def attend(self, qkv, docs=None):
        if docs is None or self.recompute != "selective":
            return super().attend(qkv, docs)

        def fn(y):  # the bug: backward's recomputation (grad enabled) forgets the documents
            return self.attention_core(y, None if torch.is_grad_enabled() else docs)
        return Recompute.apply(fn, qkv)


@mutant("tp-packed-recompute-without-mask", base="tensor.megatron",
        overrides={**LLAMA, "pack_docs": "3", "recompute": "selective"},
        bug="selective recompute re-runs the attention core causal only, not within documents")
class TPPackedRecomputeMaskless(with_model(Megatron1D, _MasklessRecompute)):
    pass
