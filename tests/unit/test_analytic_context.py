"""Closed forms of context parallelism (``parbench.analytic.context``) against the papers'
formulas and hand counts, and the ring layouts / block plans of ``impls.context`` against a
brute-force enumeration of the causal mask."""
from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from impls.context.layout import positions, usp_positions
from impls.context.ring import block_plan
from parbench.analytic import Shape, summarize, ulysses_paper_per_link
from parbench.analytic.activations import korthikanti_layer_bytes
from parbench.analytic.context import (attention_traffic, causal_block_work, context_prediction,
                                       cp_layer_activation_bytes, gradient_allreduce, imbalance,
                                       korthikanti_cp_layer_bytes, replica_states,
                                       ring_self_attention_traffic, ulysses_vs_megatron_sp)


# ---- DeepSpeed issue 4217: Ulysses 4Nh/P against Megatron-SP 4Nh ----------------------------


@pytest.mark.parametrize("p", [2, 4, 8, 16])
def test_megatron_sp_moves_p_times_ulysses_bytes(p):
    # Jacobs et al. 2023, Sec. 3.2: Ulysses 4Nh/P per link, Megatron-SP 4Nh -- a factor P. With
    # the (P-1)/P of real collectives on both sides the factor stays exactly P.
    b, s, h = 1, 1024, 64
    f = ulysses_vs_megatron_sp(b, s, h, p, bytes_per_element=1)
    assert f["ratio_megatron_sp_over_ulysses"] == p
    assert f["ulysses_fwd_bytes_per_layer"] == 4 * (p - 1) * b * s * h / p**2
    assert f["megatron_sp_fwd_bytes_per_layer"] == 4 * (p - 1) * b * s * h / p
    assert f["paper_ulysses_per_link"] == ulysses_paper_per_link(b * s, h, p) == 4 * s * h / p
    assert f["paper_megatron_sp_per_link"] / f["paper_ulysses_per_link"] == p


# ---- traffic per scheme -----------------------------------------------------------------------


def test_ring_self_attention_traffic_by_hand():
    # b=1, s=16, h=8, N=4, fp32: blocks of 4 tokens x 8 x 4 B = 128 B; K and V ring 3 hops each
    # forward, again in backward; dV and dK of the whole sequence (16 x 8 x 4 = 512 B)
    # all-reduced: 2 x 3/4 x 512 = 768 B each
    tr = ring_self_attention_traffic(1, 16, 8, 4, bytes_per_element=4)
    assert [(t.op, t.message_bytes, t.count) for t in tr] == [
        ("send", 128, 3), ("send", 128, 3), ("send", 128, 3), ("send", 128, 3),
        ("all_reduce", 512, 2)]
    assert summarize(tr)["cp"]["wire_bytes"] == 12 * 128 + 2 * 768
    again = summarize(ring_self_attention_traffic(1, 16, 8, 4, bytes_per_element=4,
                                                   recompute=True))["cp"]
    assert again["count"] == 6 + 6 + 6 + 2  # the forward's K and V rings once more


def test_ring_self_attention_moves_k_and_v_at_the_kv_width():
    # grouped-query attention, 8 wide queries over K/V 4 wide (b=1, s=16, N=4, fp32): K and V
    # blocks of 4 tokens x 4 x 4 B = 64 B, 3 hops each, 4 rings; dV, dK of the whole sequence
    # 16 x 4 x 4 = 256 B all-reduced
    tr = attention_traffic("ring-self-attention", 1, 16, 8, 4, bytes_per_element=4, h_kv=4)
    assert [(t.op, t.message_bytes, t.count) for t in tr] == [
        ("send", 64, 3), ("send", 64, 3), ("send", 64, 3), ("send", 64, 3),
        ("all_reduce", 256, 2)]


def test_attention_traffic_per_kind_counts():
    b, s, h, cp, L, m, e = 2, 32, 16, 4, 3, 2, 4
    per = {k: summarize(attention_traffic(k, b, s, h, cp, 2, L, m, e)) for k in
           ("ring-attention", "ulysses", "allgather", "usp", "ring-self-attention")}
    assert per["ring-attention"]["cp"]["count"] == 3 * (cp - 1) * L * m
    assert per["ring-attention"]["cp"]["message_bytes"] == 3 * (cp - 1) * L * m * 2 * b * 8 * h * e
    assert per["ulysses"]["cp"]["count"] == 8 * L * m
    assert per["allgather"]["cp"]["count"] == (4 + 2) * L * m  # 4 gathers, 2 reduce-scatters
    # USP on a 2 x 2 grid: Ulysses all-to-alls of b (s/cp) h on the u-groups; ring of the
    # gathered s/r tokens at h/u width on the r-groups
    assert per["usp"]["cp_ulysses"]["count"] == 8 * L * m
    assert per["usp"]["cp_ulysses"]["message_bytes"] == 8 * L * m * b * (s // cp) * h * e
    assert per["usp"]["cp_ring"]["count"] == 3 * 1 * L * m
    assert per["usp"]["cp_ring"]["message_bytes"] == 3 * L * m * 2 * b * (s // 2) * (h // 2) * e


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_usp_reduces_to_ulysses_and_to_ring(cp):
    b, s, h, e = 1, 64, 32, 4
    uly = summarize(attention_traffic("ulysses", b, s, h, cp, bytes_per_element=e))["cp"]
    ring = summarize(attention_traffic("ring-attention", b, s, h, cp, bytes_per_element=e))["cp"]
    as_uly = summarize(attention_traffic("usp", b, s, h, cp, cp, bytes_per_element=e))
    as_ring = summarize(attention_traffic("usp", b, s, h, cp, 1, bytes_per_element=e))
    assert as_uly["cp_ulysses"] == uly and "cp_ring" not in as_uly
    assert as_ring["cp_ring"] == ring and "cp_ulysses" not in as_ring


def test_gradients_and_states_of_a_replica():
    shape = Shape(vocab_size=128, hidden_size=32, num_layers=2, num_heads=4, seq_length=16)
    psi = 128 * 32 + 16 * 32 + 2 * (12 * 32 * 32 + 13 * 32) + 2 * 32 + 128 * 32
    tensors = 2 + 2 * 12 + 3
    [ar] = gradient_allreduce(shape, cp=2, dp=2)
    assert (ar.axis, ar.op, ar.group_size, ar.message_bytes, ar.count) == \
        ("dp_cp", "all_reduce", 4, 4 * psi, 1)
    assert replica_states(shape) == {"params": 4 * psi, "grads": 4 * psi,
                                     "optimizer": 8 * psi + 4 * tensors, "other": 0}
    pred = context_prediction("ring-attention", shape, cp=2, dp=2, micro_batch_size=2)
    assert pred.calls == {"cp": 3 * 1 * 2, "dp_cp": 1}  # 3 rings of cp-1 hops, 2 layers
    assert pred.wire_bytes["dp_cp"] == 2 * 3 / 4 * 4 * psi
    alone = context_prediction("ulysses", shape, cp=1, micro_batch_size=2)
    assert alone.calls == {} and alone.wire_bytes == {}


# ---- causal load balance ------------------------------------------------------------------------


@given(cp=st.sampled_from([1, 2, 3, 4, 8]), chunk=st.integers(1, 6),
       balance=st.sampled_from(["none", "zigzag", "striped"]))
@settings(max_examples=40, deadline=None)
def test_every_layout_covers_the_causal_triangle_once(cp, chunk, balance):
    """The ring's block plans evaluate every (query, key) pair with key <= query exactly once
    and no other, and each rank's count is the closed form's."""
    s = 2 * cp * chunk
    n = s // cp
    pos = [positions(s, cp, r, balance).tolist() for r in range(cp)]
    assert sorted(p for ps in pos for p in ps) == list(range(s))
    seen: set = set()
    for r in range(cp):
        pairs = 0
        for src in range(cp):
            for (q0, q1), (k0, k1), causal in block_plan(balance, r, src, n):
                for i in range(q0, q1):
                    for j in range(k0, k1):
                        if causal and j - k0 > i - q0:
                            continue
                        pair = (pos[r][i], pos[src][j])
                        assert pair[1] <= pair[0] and pair not in seen, (balance, r, src, pair)
                        seen.add(pair)
                        pairs += 1
        assert pairs == causal_block_work(s, cp, balance)[r]
    assert len(seen) == s * (s + 1) // 2


def test_imbalance_of_contiguous_causal_ring_attention():
    # Brandon et al. 2023, Sec. 3: with contiguous shards the last device computes N - 1/2
    # blocks against a mean of N/2, so the causal ring waits for (2N-1)/N of the balanced time
    for cp in (2, 4, 8):
        work = causal_block_work(2**14, cp, "none")
        assert imbalance(work) == pytest.approx((2 * cp - 1) / cp, rel=1e-3)
        assert imbalance(causal_block_work(2**14, cp, "zigzag")) == 1.0
        assert imbalance(causal_block_work(2**14, cp, "striped")) == pytest.approx(1, rel=1e-3)
    # by hand: s=4 on 2 ranks, contiguous: rank 0 (q0,k0) (q1,k0) (q1,k1); rank 1 adds 4
    assert causal_block_work(4, 2, "none") == [3, 7]
    assert causal_block_work(4, 2, "zigzag") == [5, 5]
    assert causal_block_work(4, 2, "striped") == [4, 6]


def test_llama3_zigzag_layout_and_usp_pieces():
    # Llama 3 (Dubey et al. 2024, Sec. 3.3.2): 2 x CP chunks, rank i holds chunks i and
    # 2 x CP - 1 - i
    assert positions(8, 2, 0, "zigzag").tolist() == [0, 1, 6, 7]
    assert positions(8, 2, 1, "zigzag").tolist() == [2, 3, 4, 5]
    assert positions(8, 2, 1, "striped").tolist() == [1, 3, 5, 7]
    # USP 2 x 2: the ring rank's zig-zag tokens, cut into contiguous Ulysses pieces
    ring0 = positions(16, 2, 0, "zigzag").tolist()
    assert usp_positions(16, 2, 2, 0, 0, "zigzag").tolist() == ring0[:4]
    assert usp_positions(16, 2, 2, 1, 0, "zigzag").tolist() == ring0[4:]


# ---- activations ------------------------------------------------------------------------------


def test_activations_on_the_sequence_shard():
    s, b, h, a, cp = 64, 2, 32, 4, 4
    # every layout keeps the per-token activations of s/cp tokens
    for kind in ("ring-attention", "ulysses", "usp", "allgather"):
        assert cp_layer_activation_bytes(kind, s, b, h, a, cp) == \
            cp_layer_activation_bytes(kind, s // cp, b, h, a, 1)
    # Ring Self-Attention keeps its (s/cp) x s score rows instead of the kernel's output
    rsa = cp_layer_activation_bytes("ring-self-attention", s, b, h, a, cp)
    flash = cp_layer_activation_bytes("ring-attention", s, b, h, a, cp)
    n = s // cp
    assert rsa - flash == a * n * s * b * 4 - (n * b * h * 4 + a * n * b * 4)
    # full recomputation: the layer input only
    assert cp_layer_activation_bytes("ulysses", s, b, h, a, cp, "full") == 4 * n * b * h
    # grouped-query attention: K and V kept at h_kv = 8 instead of 32 (2 (h - h_kv) n b
    # elements fewer); RSA's score rows are one per query head either way
    for kind in ("ring-attention", "ring-self-attention"):
        mha = cp_layer_activation_bytes(kind, s, b, h, a, cp)
        gqa = cp_layer_activation_bytes(kind, s, b, h, a, cp, kv_hidden=8)
        assert mha - gqa == 2 * (32 - 8) * n * b * 4
    # Korthikanti et al. 2022, Eq. 1, on the shard: GPT-3 175B's layer (s 2048, h 12288,
    # a 96, b 1) is sbh (34 + 5as/h) = 2048 * 12288 * 114 bytes; with cp the query rows
    # shrink, so the s^2 term falls by cp^2
    assert korthikanti_layer_bytes(2048, 1, 12288, 96) == 2048 * 12288 * 114
    assert korthikanti_cp_layer_bytes(2048, 1, 12288, 96, 2) == \
        1024 * 12288 * (34 + Fraction(5 * 96 * 1024, 12288))


def test_grouped_query_attention_moves_kv_at_the_kv_heads_width():
    """K and V of num_kv_heads x head_dim columns (Ainslie et al. 2023) in every algorithm:
    the ring's message is 2 b (s/cp) h_kv elements, all-gather CP's gathered tensor
    b s h_kv, Ulysses' Q and output at h and K, V at h_kv -- written here from those
    definitions; estimate counts a tensor-parallel rank's share (one whole head when tp
    exceeds the K/V heads)."""
    from parbench.analytic import estimate
    from parbench.config import model_preset
    from parbench.layout import Layout
    from parbench.options import Options
    b, s, h, kv, cp, e = 1, 64, 32, 16, 2, 4
    ring = attention_traffic("ring-attention", b, s, h, cp, bytes_per_element=e, h_kv=kv)
    assert {t.message_bytes for t in ring} == {2 * b * (s // cp) * kv * e}
    gather = attention_traffic("allgather", b, s, h, cp, bytes_per_element=e, h_kv=kv)
    assert {t.message_bytes for t in gather} == {b * s * kv * e}
    uly = attention_traffic("ulysses", b, s, h, cp, bytes_per_element=e, h_kv=kv)
    assert sorted((t.message_bytes, t.count) for t in uly) == \
        [(b * (s // cp) * kv * e, 4), (b * (s // cp) * h * e, 4)]
    mha = attention_traffic("ulysses", b, s, h, cp, bytes_per_element=e)
    assert summarize(uly)["cp"]["wire_bytes"] < summarize(mha)["cp"]["wire_bytes"]
    # LLaMA-3 70B (8 K/V heads of 128): tp = 4 leaves two K/V heads per rank, tp = 8 one
    shape = model_preset("llama3-70b")
    for tp in (4, 8):
        width = 8 // tp * 128
        for algo, per_msg in (("ring-attention", 2 * 1 * 4096 * width * 2),
                              ("allgather", 1 * 8192 * width * 2)):
            est = estimate(shape, Layout(tp=tp, cp=2, micro_batch_size=1),
                           Options().with_values(sp=True, cp_algorithm=algo))
            msgs = {t.message_bytes for t in est.communication.transfers if t.axis == "cp"}
            assert msgs == {per_msg}, (tp, algo, msgs)
