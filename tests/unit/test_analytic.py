"""Closed forms of parbench.analytic against the papers and hand derivations.

Expected figures are written out here from the papers (cited per test) or derived by hand in
the comments; none is produced by the code under test.
"""
from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parbench.analytic import (FP32_ADAMW, MIXED_ADAM_FP32_GRAD, Shape, estimate_params,
                               first_stage_activation_bytes, forward_flops, kv_cache_bytes,
                               largest_model_fits, layer_activation_bytes, layer_params, mfu,
                               megatron_eq3_flops, shape_forward_flops, stage_params,
                               textbook_layer_params, textbook_total_params, total_params,
                               training_flops, zero_model_states, zero_model_states_exact)
from parbench.analytic.memory import round_sig
from parbench.analytic.shape import GB, GiB
from parbench.layout import Layout

FAST = settings(max_examples=60, deadline=None)

heads = st.integers(1, 8)
head_dim = st.integers(1, 48)
layers = st.integers(1, 12)
vocab = st.integers(1, 60000)
seq = st.integers(1, 4096)


# ---------------------------------------------------------------------------------------
# parameters
# ---------------------------------------------------------------------------------------

@FAST
@given(heads, head_dim, layers, vocab)
def test_exact_layer_count_is_12h2_plus_13h_for_f_4h(a, d, l, V):  # noqa: E741, N803
    h = a * d
    shape = Shape(vocab_size=V, hidden_size=h, num_layers=l, num_heads=a, seq_length=8,
                  position_embeddings=False)
    assert layer_params(shape) == 12 * h * h + 13 * h
    assert textbook_layer_params(h) == 12 * h * h + 13 * h
    # untied, no positions: embedding Vh + l layers + final LN 2h + head Vh
    assert total_params(shape) == l * (12 * h * h + 13 * h) + 2 * V * h + 2 * h


@FAST
@given(heads, head_dim, layers, vocab, seq)
def test_tied_model_with_positions_is_narayanan_formula_plus_final_ln(a, d, l, V, s):  # noqa
    h = a * d
    # Narayanan et al. 2021, Sec. 5.1, as printed: P = 12lh^2 (1 + 13/(12h) + (V+s)/(12lh))
    printed = 12 * l * h * h * (1 + Fraction(13, 12 * h) + Fraction(V + s, 12 * l * h))
    assert textbook_total_params(h, l, V, s) == printed
    shape = Shape(vocab_size=V, hidden_size=h, num_layers=l, num_heads=a, seq_length=s,
                  tie_embeddings=True, position_embeddings=True)
    assert total_params(shape) == printed + 2 * h  # + final LayerNorm, not in the formula


def test_tiny_model_counted_tensor_by_tensor():
    # h=4, f=16, V=10, s=8, 2 layers, untied, learned positions; shapes listed by hand
    shape = Shape(vocab_size=10, hidden_size=4, num_layers=2, num_heads=2, seq_length=8)
    per_layer = (4 + 4) + (4 * 12 + 12) + (4 * 4 + 4) + (4 + 4) + (4 * 16 + 16) + (16 * 4 + 4)
    assert per_layer == 244
    assert layer_params(shape) == 244
    assert total_params(shape) == 10 * 4 + 8 * 4 + 2 * 244 + 8 + 4 * 10


def test_count_matches_the_reference_model():
    import torch

    from parbench.analytic import shape_from
    from parbench.config import ModelConfig
    from parbench.model import build_model
    for kw in ({}, {"tie_embeddings": True}, {"position_embeddings": False},
               {"ffn_hidden_size": 24}):
        cfg = ModelConfig(vocab_size=50, hidden_size=16, num_layers=3, num_heads=4,
                          seq_length=12, **kw)
        with torch.no_grad():
            model = build_model(cfg, seed=0)
        assert sum(p.numel() for p in model.parameters()) == total_params(shape_from(cfg))


def test_moe_layer_by_hand():
    # h=4, f=16, E=4: LNs 16, QKV 60, proj 20, router 4*4, experts 4 * (2*4*16 + 16 + 4)
    shape = Shape(vocab_size=10, hidden_size=4, num_layers=1, num_heads=2, seq_length=8,
                  num_experts=4, moe_top_k=2)
    assert layer_params(shape) == 16 + 60 + 20 + 16 + 4 * 148
    # ep=2, tp=2: 2 experts, each (2*4*16 + 16)/2 + 4 = 76; router replicated
    assert layer_params(shape, tp=2, ep=2) == 16 + 30 + (8 + 4) + 16 + 2 * 76


def test_tensor_parallel_rank_by_hand():
    # h=8, f=32, t=2: LN 16+16, QKV (3*64 + 24)/2, proj 64/2 + 8, fc1 (256+32)/2, fc2 256/2 + 8
    shape = Shape(vocab_size=16, hidden_size=8, num_layers=2, num_heads=2, seq_length=4)
    assert layer_params(shape, tp=2) == 32 + 108 + 40 + 144 + 136


@FAST
@given(st.sampled_from([1, 2, 4, 8]), st.integers(1, 6), layers, st.integers(1, 50))
def test_tensor_parallel_shards_add_up(t, d, l, v):  # noqa: E741
    a = 8
    h = a * d
    shape = Shape(vocab_size=v * 8, hidden_size=h, num_layers=l, num_heads=a, seq_length=8)
    replicated = 4 * h + h + h  # two LNs, row-parallel biases of proj and fc2
    assert t * layer_params(shape, tp=t) - (t - 1) * replicated == layer_params(shape)


def test_pipeline_stages():
    shape = Shape(vocab_size=10, hidden_size=4, num_layers=4, num_heads=2, seq_length=8)
    st2 = stage_params(shape, pp=2)
    assert [r["layers"] for r in st2] == [2, 2]
    assert st2[0]["embedding"] == 10 * 4 + 8 * 4 and st2[1]["embedding"] == 0
    assert st2[1]["head"] == 8 + 40 and st2[0]["head"] == 0
    assert sum(r["total"] for r in st2) == total_params(shape)
    tied = Shape(vocab_size=10, hidden_size=4, num_layers=4, num_heads=2, seq_length=8,
                 tie_embeddings=True)
    # tied across stages: the last stage holds its own copy of the V h word embedding
    assert sum(r["total"] for r in stage_params(tied, pp=2)) == total_params(tied) + 40
    assert [r["layers"] for r in stage_params(shape, pp=2, layers_per_stage=[3, 1])] == [3, 1]


@pytest.mark.parametrize("kw, message", [
    ({"pp": 3}, "pp=3 does not divide num_layers=4"),
    ({"pp": 2, "vpp": 4}, "pp*vpp=8 does not divide num_layers=4"),
    ({"tp": 3}, "tp=3 does not divide num_heads=4"),
    ({"pp": 2, "layers_per_stage": [1, 2]}, "sums to 3, not num_layers=4"),
])
def test_bad_splits_are_refused_with_field_value_rule(kw, message):
    shape = Shape(vocab_size=12, hidden_size=12, num_layers=4, num_heads=4, seq_length=8)
    with pytest.raises(ValueError, match=message.replace("*", r"\*")):
        stage_params(shape, **kw)


# ---------------------------------------------------------------------------------------
# FLOPs
# ---------------------------------------------------------------------------------------

def test_forward_flops_by_hand():
    # b=1, s=2, h=4, l=1, V=3; each matmul (m x k)(k x n) costs 2mkn
    qkv, scores, av, proj = 2 * 2 * 4 * 12, 2 * 2 * 2 * 4, 2 * 2 * 2 * 4, 2 * 2 * 4 * 4
    mlp = 2 * (2 * 2 * 4 * 16)
    logits = 2 * 2 * 4 * 3
    assert forward_flops(1, 2, 4, 1, 3) == qkv + scores + av + proj + mlp + logits == 880


@FAST
@given(st.integers(1, 64), st.integers(1, 4096), layers, st.integers(1, 8192),
       st.integers(1, 100000))
def test_megatron_eq3_is_4x_layers_plus_3x_logits(B, s, l, h, V):  # noqa: E741, N803
    # Narayanan et al. 2021, Eq. 3: 96 B s l h^2 (1 + s/(6h) + V/(16lh))
    #   = 96Bslh^2 + 16Bs^2lh + 6BshV = 4 l (24Bsh^2 + 4Bs^2h) + 3 (2BshV)
    eq3 = megatron_eq3_flops(B, s, l, h, V)
    layers_fwd = l * (24 * B * s * h * h + 4 * B * s * s * h)
    assert eq3 == 4 * layers_fwd + 3 * 2 * B * s * h * V
    assert eq3 == training_flops(B, s, h, l, V, recompute=True)
    # multiplying the whole forward count by 4 overcounts the logit layer by 2BshV
    assert 4 * forward_flops(B, s, h, l, V) - eq3 == 2 * B * s * h * V


@FAST
@given(st.integers(1, 16), st.integers(1, 2048), layers, st.integers(1, 4096),
       st.integers(1, 50000))
def test_six_flops_per_parameter_per_token(B, s, l, h, V):  # noqa: E741, N803
    # 6 x (12 l h^2 + V h) per token accounts for everything but the attention scores,
    # whose 3 x 4Bs^2h l is the remainder
    exact = training_flops(B, s, h, l, V)
    assert exact - 6 * (12 * l * h * h + V * h) * B * s == 12 * B * s * s * h * l


@FAST
@given(heads, head_dim, layers, st.integers(1, 1000), st.integers(1, 8), st.integers(1, 512))
def test_shape_flops_reduce_to_the_textbook_for_dense_4h(a, d, l, V, b, s):  # noqa: E741
    h = a * d
    shape = Shape(vocab_size=V, hidden_size=h, num_layers=l, num_heads=a, seq_length=s)
    assert shape_forward_flops(shape, b) == forward_flops(b, s, h, l, V)


def test_mfu():
    # 8e14 FLOPs in 2 s on 4 devices = 1e14 FLOP/s each; peak 2e14 -> 50 %
    assert mfu(8e14, 2.0, 2e14, 4) == pytest.approx(0.5)


# ---------------------------------------------------------------------------------------
# model-state memory (Rajbhandari et al. 2020)
# ---------------------------------------------------------------------------------------

def test_zero_paper_figure_1_and_table_1():
    # Psi = 7.5B, Nd = 64, K = 12 -- printed: 120GB, 31.4GB, 16.6GB, 1.88 (Table 1; Figure 1
    # rounds the last to 1.9GB). GB = 1e9: the binary reading would print 111.8, 29.2, ...
    got = [zero_model_states(7.5e9, 64, stage).total for stage in range(4)]
    assert [round_sig(x / GB, 3) for x in got] == [120, 31.4, 16.6, 1.88]
    assert round_sig(got[3] / GB, 2) == 1.9
    assert round_sig(got[1] / GiB, 3) != 31.4
    # further Table 1 cells: 7.5B Nd=4 P_os+g+p 30; 7.5B Nd=16 P_os+g 21.6;
    # 128B Nd=64 P_os+g+p 32; 1T Nd=1024 P_os+g+p 15.6
    assert round_sig(zero_model_states(7.5e9, 4, 3).total / GB, 3) == 30
    assert round_sig(zero_model_states(7.5e9, 16, 2).total / GB, 3) == 21.6
    assert round_sig(zero_model_states(128e9, 64, 3).total / GB, 3) == 32
    assert round_sig(zero_model_states(1e12, 1024, 3).total / GB, 3) == 15.6


def test_estimate_reproduces_the_zero_example():
    out = estimate_params(7.5e9, Layout(micro_batch_size=1, dp=64))
    assert out.memory.model_states.zero_paper_gb == {
        "baseline": 120, "P_os": 31.4, "P_os+g": 16.6, "P_os+g+p": 1.88}


def test_zero_paper_table_2_max_model_size():
    # Table 2, MP = 1, 64 V100s of 32 GB: 2B, 7.6B, 14.4B, 128B
    sizes = [largest_model_fits(32e9, 64, stage) / 1e9 for stage in range(4)]
    assert [round(x, 1) for x in sizes] == [2.0, 7.6, 14.4, 128.0]
    # MP = 16 on 1024 GPUs (Nd = 64), P_os+g+p: printed "2T"
    assert round_sig(largest_model_fits(32e9, 64, 3, mp=16), 1) == 2e12


def test_twenty_and_sixteen_byte_accountings():
    psi, nd = 1000, 8
    # 20 bytes: fp16 p 2 + fp16 g 2 + fp32 master, grad copy, m, v 16
    assert zero_model_states(psi, nd, 0, MIXED_ADAM_FP32_GRAD).total == 20 * psi
    assert zero_model_states(psi, nd, 1, MIXED_ADAM_FP32_GRAD).total == 4 * psi + 16 * psi / nd
    assert zero_model_states(psi, nd, 2, MIXED_ADAM_FP32_GRAD).total == 2 * psi + 18 * psi / nd
    # fp32 AdamW: p 4 + g 4 + m, v 8
    assert zero_model_states(psi, nd, 2, FP32_ADAMW).total == 4 * psi + 12 * psi / nd
    assert zero_model_states(psi, nd, 3, "fp32_adamw").total == 16 * psi / nd


def test_exact_flat_partition():
    # 10 elements over 4 ranks: padded to 12, shards of 3; rank 3 holds element 9 only
    ex = zero_model_states_exact(10, 4, 3, FP32_ADAMW, rank=3)
    assert ex["padded"].total == 3 * 16
    assert ex["unpadded"].total == 1 * 16
    ex1 = zero_model_states_exact(10, 4, 1, FP32_ADAMW, rank=3)
    assert (ex1["padded"].param, ex1["padded"].grad, ex1["padded"].optim) == (40, 40, 24)
    assert ex1["unpadded"].optim == 8
    assert zero_model_states_exact(10, 4, 3, FP32_ADAMW, rank=0)["unpadded"].total == 48


def test_kv_cache():
    # 4 b l h (s + n): b=1, l=32, h=4096, s+n=4096 -> 4 * 32 * 2^12 * 2^12 = 2^31 bytes
    assert kv_cache_bytes(1, 32, 4096, 3072, 1024) == 2 * GiB


# ---------------------------------------------------------------------------------------
# activations (Korthikanti et al. 2022, Table 2)
# ---------------------------------------------------------------------------------------

@FAST
@given(st.integers(1, 4096), st.integers(1, 8), st.sampled_from([1, 2, 4, 8]),
       st.integers(1, 64), st.integers(1, 4))
def test_activation_formulas_of_table_2(s, b, t, d, k):
    a = 8 * k
    h = a * d
    sbh = s * b * h

    def got(**kw):
        return layer_activation_bytes(s, b, h, a, t, **kw)

    assert got(sp=False) == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    assert got(sp=True) == pytest.approx(sbh / t * (34 + 5 * a * s / h))
    assert got(sp=False, recompute="selective") == pytest.approx(sbh * (10 + 24 / t))
    assert got(sp=True, recompute="selective") == pytest.approx(34 * sbh / t)
    assert got(sp=False, recompute="full") == 2 * sbh
    if t == 1:
        assert got() == pytest.approx(sbh * (34 + 5 * a * s / h))


def test_gpt3_layer_by_hand():
    # GPT-3 175B (Korthikanti et al. 2022): s=2048, h=12288, a=96 -> 5as/h = 80
    s, h, a = 2048, 12288, 96
    assert layer_activation_bytes(s, 1, h, a) == s * h * (34 + 80)


def test_first_stage_holds_all_layers_once():
    # 1F1B: p micro-batches of L/p layers = L layers' worth; interleaved x (1 + (p-1)/(pm))
    assert first_stage_activation_bytes(10.0, 32, 4) == 320.0
    assert first_stage_activation_bytes(10.0, 32, 4, vpp=2) == pytest.approx(320 * (1 + 3 / 8))
    assert first_stage_activation_bytes(10.0, 32, 4, num_microbatches=2) == 160.0
    assert first_stage_activation_bytes(10.0, 32, 4, num_microbatches=6, schedule="gpipe") == 480.0
