"""Communication formulas and the UB-Mesh traffic table, against hand computations and the
paper's printed values."""
from __future__ import annotations

import dataclasses
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parbench.analytic import (Counting, Shape, UBMeshMoE2T, compare_with_published,
                               ddp_traffic, estimate, expert_traffic, field_sources,
                               pipeline_p2p_traffic, pipeline_total_sends, published_ubmesh_table,
                               ring_attention_traffic, summarize, tp_traffic, traffic_table,
                               ulysses_paper_per_link, ulysses_traffic, wire_bytes, zero_traffic)
from parbench.analytic.comm import rooted_wire_factor
from parbench.analytic.shape import GiB, MiB
from parbench.layout import Layout


def test_ring_wire_bytes_by_hand():
    assert wire_bytes("all_reduce", 4, 100) == 150          # 2 * 3/4 * 100
    assert wire_bytes("all_gather", 4, 100) == 75           # 3/4 * 100
    assert wire_bytes("reduce_scatter", 4, 100) == 75
    assert wire_bytes("all_to_all", 8, 64) == 56            # 7/8 * 64
    assert wire_bytes("broadcast", 4, 100) == 100
    assert wire_bytes("send", 2, 100) == 100
    assert wire_bytes("all_reduce", 1, 100) == 0
    assert wire_bytes("all_reduce", 3, 10) == pytest.approx(40 / 3)
    assert wire_bytes("reduce", 4, 100) == 100              # a non-root rank of the chain
    assert rooted_wire_factor("reduce", 4, 0, 0) == 0       # the root sends nothing
    assert rooted_wire_factor("broadcast", 4, 3, 0) == 0    # the chain's last rank
    assert rooted_wire_factor("broadcast", 4, 0, 0) == 1
    assert rooted_wire_factor("scatter", 4, 2, 2) == Fraction(3, 4)
    assert rooted_wire_factor("gather", 4, 1, 2) == Fraction(1, 4)
    with pytest.raises(ValueError, match="op='gossip'"):
        wire_bytes("gossip", 2, 1)


def test_ddp_and_zero_volumes():
    # Psi = 1000 fp32 gradients on d = 4: 2 * 3/4 * 4000 = 6000 bytes
    ddp = summarize(ddp_traffic(4000, 4))["dp"]
    assert ddp["wire_bytes"] == 6000 and ddp["message_bytes"] == 4000
    z2 = summarize(zero_traffic(1000, 4, 2, param_bytes=4))["dp"]
    assert z2["message_bytes"] == 2 * 4000 and z2["wire_bytes"] == 6000    # 2 Psi, as DDP
    z3 = summarize(zero_traffic(1000, 4, 3, param_bytes=4))["dp"]
    assert z3["message_bytes"] == 3 * 4000 and z3["wire_bytes"] == 9000    # 3 Psi, 1.5x
    # padding: 10 elements over 4 ranks travel as 12
    assert summarize(zero_traffic(10, 4, 1, param_bytes=1))["dp"]["message_bytes"] == 24


def test_megatron_tp_per_layer_per_microbatch():
    # b=2, s=8, h=16, t=4, 2-byte elements: S = bsh * 2 = 512 bytes;
    # 4 all-reduces x 2 * 3/4 * 512 = 3072 = 8 bsh (t-1)/t * 2
    b, s, h, t = 2, 8, 16, 4
    assert summarize(tp_traffic(b, s, h, t))["tp"]["wire_bytes"] == 8 * b * s * h * 3 // 4 * 2
    assert summarize(tp_traffic(b, s, h, t))["tp"]["count"] == 4
    assert summarize(tp_traffic(b, s, h, t, recompute=True))["tp"]["wire_bytes"] == 4608
    sp = summarize(tp_traffic(b, s, h, t, sp=True))["tp"]
    assert sp["wire_bytes"] == 3072 and sp["count"] == 8  # 4 all-gathers + 4 reduce-scatters
    assert tp_traffic(b, s, h, 1) == []


def test_ulysses_against_the_paper_per_link_volume():
    # N=1024 tokens, h=64, P=4: the paper's 4Nh/P = 65536 elements per link per layer
    # (aggregate message Nh, M/P per link); one rank's forward wire is 4 x 3/4 x (N/P) h
    assert ulysses_paper_per_link(1024, 64, 4) == 65536
    fwd = summarize(ulysses_traffic(1, 1024, 64, 4, bytes_per_element=1, backward=False))
    assert fwd["cp"]["wire_bytes"] == 4 * 3 * 256 * 64 // 4 == 65536 * 3 // 4


def test_ring_attention_exchanges():
    # cp=4, s=16, b=1, h_kv=8, 2-byte: K,V block 2 * 4 * 8 * 2 = 128 bytes; 3 hops forward,
    # backward K,V and dK,dV 3 hops each
    tr = ring_attention_traffic(1, 16, 8, 4, bytes_per_element=2)
    assert [(t.message_bytes, t.count) for t in tr] == [(128, 3), (128, 3), (128, 3)]
    assert summarize(tr)["cp"]["wire_bytes"] == 9 * 128


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 8), st.integers(1, 16), st.integers(1, 4))
def test_pipeline_sends_sum_to_2m_pv_minus_1(p, m, v):
    total = sum(t.count for r in range(p)
                for t in pipeline_p2p_traffic(1, 4, 4, p, m, rank=r, vpp=v))
    assert total == 2 * m * (p * v - 1) == pipeline_total_sends(p, m, v)


def test_pipeline_rank_views_and_scatter_gather():
    first = pipeline_p2p_traffic(2, 8, 16, 4, 8, rank=0, bytes_per_element=2)
    assert [(t.what, t.count, t.message_bytes) for t in first] == [("activations", 8, 512)]
    last = pipeline_p2p_traffic(2, 8, 16, 4, 8, rank=3)
    assert [(t.what, t.count) for t in last] == [("activation gradients", 8)]
    sg = pipeline_p2p_traffic(2, 8, 16, 4, 8, rank=1, tp=4, scatter_gather=True)
    assert sg[0].message_bytes == 512 // 4
    assert sg[-1].op == "all_gather" and sg[-1].axis == "tp" and sg[-1].count == 16


def test_expert_all_to_alls():
    # 512 tokens of h = 12288 in bf16 on ep = 8: 7/8 * 512 * 12288 * 2 = 10.5 MiB per a2a
    tr = expert_traffic(512, 12288, 8, moe_layers=1, bytes_per_element=2)
    assert tr[0].wire_bytes == 10.5 * MiB and tr[0].count == 4
    # capacity: 10 tokens, top-2, 4 experts, cf 1.25 -> 4 slots of ceil(6.25) = 7 rows
    cap = expert_traffic(10, 4, 2, top_k=2, capacity_factor=1.25, num_experts=4,
                         bytes_per_element=1)
    assert cap[0].message_bytes == 28 * 4


def test_estimate_dp_traffic_is_ddp_formula():
    shape = Shape(vocab_size=64, hidden_size=16, num_layers=4, num_heads=4, seq_length=8)
    lay = Layout(micro_batch_size=2, dp=4).with_global_batch(8)
    out = estimate(shape, lay, counting=Counting(bytes_per_element=4))
    psi = out.parameters.total
    assert out.communication.per_axis["dp"]["wire_bytes"] == 2 * 3 * psi * 4 // 4
    assert out.inputs.num_microbatches == 1
    with pytest.raises(ValueError, match="global_batch_size=8 is not a positive multiple of "
                                         "micro_batch_size\\*dp=6"):
        estimate(shape, Layout(micro_batch_size=2, dp=3).with_global_batch(8))


# ---------------------------------------------------------------------------------------
# UB-Mesh Table 1 (arXiv 2503.20377)
# ---------------------------------------------------------------------------------------

def test_ubmesh_table_matches_every_printed_cell_but_the_two_printing_errors():
    checks = compare_with_published(traffic_table(UBMeshMoE2T()))
    assert len(checks) == 5 * 5
    bad = {(c.parallelism, c.column): c for c in checks if not c.ok}
    assert set(bad) == {("TP", "total"), ("PP", "share")}
    assert "1755" in bad["TP", "total"].note and "52.9%" in bad["TP", "total"].note
    assert "0.147%" in bad["PP", "share"].note and "100%" in bad["PP", "share"].note


def test_ubmesh_cells_by_hand():
    rows = {r.parallelism: r for r in traffic_table()}
    a = 1 * 8192 * 12288 * 2  # b s h x bf16 = 192 MiB
    assert a == 192 * MiB
    assert rows["TP"].per_transfer_bytes == (2 * 15 * a // 16,) and rows["TP"].counts == (4992,)
    assert rows["SP"].per_transfer_bytes == (15 * a // 16, 15 * 2 * a // 16)
    assert rows["SP"].counts == (6 * 32 * 26, 2 * 32 * 26)
    assert rows["EP"].per_transfer_bytes == (7 * 512 * 12288 * 2 // 8,)
    assert rows["PP"].per_transfer_bytes == (a,) and rows["PP"].counts == (26,)
    assert rows["DP"].per_transfer_bytes == (711.75 * MiB,) and rows["DP"].counts == (64,)
    assert rows["TP"].total_bytes == 1755 * GiB
    assert sum(r.share for r in rows.values()) == 1


def test_ubmesh_table_follows_the_configuration():
    cfg = dataclasses.replace(UBMeshMoE2T(), tp=8, dp=2, dp_bucket_bytes=100 * MiB)
    rows = {r.parallelism: r for r in traffic_table(cfg)}
    assert rows["TP"].per_transfer_bytes == (2 * 7 * 192 * MiB // 8,)
    assert rows["DP"].per_transfer_bytes == (100 * MiB,)        # 2 (d-1)/d G with d = 2
    # EP tokens are the sequence-parallel shard 8192 / tp
    assert rows["EP"].per_transfer_bytes == (7 * 1024 * 12288 * 2 // 8,)


def test_corrected_publication_leaves_only_the_pp_share():
    published = published_ubmesh_table()
    published[0] = dict(published[0], total="1755 GB")
    bad = [(c.parallelism, c.column) for c in compare_with_published(traffic_table(), published)
           if not c.ok]
    assert bad == [("PP", "share")]


def test_preset_says_what_is_sourced():
    src = field_sources(UBMeshMoE2T)
    assert {k for k, v in src.items() if v.startswith("sourced")} == {
        "hidden_size", "num_layers", "num_heads", "num_experts"}
    assert all(v for v in src.values())


def test_the_clipping_norm_is_one_fp32_all_reduce_per_spread_axis():
    from parbench.analytic.clip import add_to, norm_transfers
    assert norm_transfers({"dp": 4, "tp": 2}, 0.0) == []
    ts = norm_transfers({"dp": 4, "tp": 1, "pp": 3}, 1.0)
    assert [(t.axis, t.op, t.message_bytes, t.count) for t in ts] == [
        ("dp", "all_reduce", 4, 1), ("pp", "all_reduce", 4, 1)]
    wire, calls = {"dp": 10}, {"dp": 2}
    add_to(wire, calls, {"dp": 4, "pp": 3}, 1.0)
    assert wire == {"dp": 10 + 6, "pp": 2 * 2 / 3 * 4} and calls == {"dp": 3, "pp": 1}
