"""Which QKV rows a tp rank holds when tp exceeds the K/V heads (issue 21): Megatron-Core's
linear_qkv is laid out group by group, [q heads of group 0, k_0, v_0 | group 1 ...], and split
into t equal blocks (``megatron/core/transformer/attention.py``); the rank then attends with
query heads [r a/t, (r+1) a/t) and the K/V head of their group, r // (t/g)."""
from __future__ import annotations

import torch

from impls.tensor import gqa
from impls.tensor.megatron_model import MegatronLayout
from parbench.config import model_preset


def rows(lo: int, hi: int) -> list[int]:
    return list(range(lo, hi))


def test_llama_tiny_tp4_rank_rows_follow_the_interleaved_split():
    """a = 4 heads of d = 8, g = 2: reference rows Q 0-31, K 32-47, V 48-63; the interleaved
    order is Q0 Q1 K0 V0 | Q2 Q3 K1 V1, 16 rows (two heads' worth) a rank."""
    lay = MegatronLayout(model_preset("llama-tiny"), 4)
    want = [rows(0, 16), rows(32, 40) + rows(48, 56), rows(16, 32), rows(40, 48) + rows(56, 64)]
    assert [lay.qkv_rows(r).tolist() for r in range(4)] == want


def test_each_rank_takes_its_query_heads_and_their_groups_kv_head():
    """The gathered interleaved output, as column numbers: rank r gets query head r's 8
    columns and the K and V columns of group r // 2."""
    cfg = model_preset("llama-tiny")
    full = gqa.interleaved_rows(cfg).view(1, 1, -1).float()  # column c holds reference row c
    for r in range(4):
        got = gqa.local_qkv(full, cfg, 4, r).view(-1).long().tolist()
        j = r // 2
        assert got == rows(8 * r, 8 * r + 8) + rows(32 + 8 * j, 40 + 8 * j) + \
            rows(48 + 8 * j, 56 + 8 * j)
    assert torch.equal(gqa.interleaved_rows(cfg).sort().values, torch.arange(64))
