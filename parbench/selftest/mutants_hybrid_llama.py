"""The hybrid on the LLaMA blocks (``llama-tiny``; issue 21) built wrongly:

- RoPE on a context-parallel chunk at its local positions 0..s/cp-1 instead of the tokens'
  global positions in the sample (the classic bug of a cp chunk; here under zig-zag chunks,
  where even rank 0's second chunk is off);
- tp above num_kv_heads (tp 4 over 2 K/V heads): the rank's query heads attend with the K/V
  head of group r mod g instead of r // (t/g) (Megatron-Core takes group rank // (t/g)).
"""
from __future__ import annotations

import torch

from impls.hybrid.model import HybridStage
from impls.hybrid.scheme import HybridScheme
from .catalogue import mutant
from .mutants_tensor_gqa import wrong_kv_query_group

DENSE = {"model": "llama-tiny", "dp": "1", "ep": "1", "pp": "1", "num_experts": "0",
         "num_microbatches": "2"}
#: tp 2 x cp 2, ring attention over zig-zag chunks
RING = {**DENSE, "tp": "2", "cp": "2", "cp_algorithm": "ring-attention",
        "cp_balance": "zigzag"}
#: tp 4 over num_kv_heads 2: the QKV output gathered (``impls.tensor.gqa``)
GQA = {**DENSE, "tp": "4", "cp": "1"}


class _LocalRope(HybridStage):
    def rope_positions(self, docs=None):
        return torch.arange(len(self.positions(0)))  # the bug: the chunk's local positions


@mutant("hybrid-rope-local-positions", base="hybrid", overrides=RING,
        bug="RoPE on a cp chunk at its local positions 0..s/cp-1, not its global ones")
class HybridRopeLocalPositions(HybridScheme):
    stage_class = _LocalRope


class _WrongKVGroup(HybridStage):
    query_group = wrong_kv_query_group


@mutant("hybrid-gqa-kv-head-rank-mod-g", base="hybrid", overrides=GQA,
        bug="tp > num_kv_heads: rank r attends with K/V head r mod g, not r // (tp/g)")
class HybridGQAWrongKVHead(HybridScheme):
    stage_class = _WrongKVGroup
