"""Closed forms of tensor parallelism (``parbench.analytic.tensor``) against the papers' own
counts and against the independent parameter table of ``analytic.params``."""
from __future__ import annotations

from fractions import Fraction

import pytest

from parbench.analytic import Shape, estimate, summarize
from parbench.analytic import tensor as T
from parbench.analytic import tensor_grid as G
from parbench.analytic.activations import (korthikanti_layer_bytes, layer_activation_bytes,
                                           reference_layer_activation_bytes)
from parbench.analytic.comm import tp_traffic
from parbench.analytic.params import (embedding_params, head_params, layer_params,
                                      total_params)
from parbench.layout import Layout
from parbench.options import Options


def shape(**kw) -> Shape:
    base = dict(vocab_size=512, hidden_size=64, num_layers=3, num_heads=8, seq_length=32)
    return Shape(**{**base, **kw})


def test_vocabulary_padding_as_megatron_pads():
    # Megatron-LM's _vocab_size_with_padding: GPT-2's 50257 with the default divisor 128
    assert T.padded_vocab(50257, 1, 128) == 50304
    assert T.padded_vocab(50257, 8, 128) == 51200  # the gpt3-175b preset's 51200
    assert T.padded_vocab(61, 2) == 62 and T.padded_vocab(3, 4) == 4
    assert T.padded_vocab(64, 4) == 64


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("tied", [False, True])
def test_megatron_rank_parameters_equal_the_parameter_table(tp, tied):
    """Against ``analytic.params`` (Narayanan et al. Sec. 5.1 with Megatron's split), for a
    vocabulary tp divides (no padding)."""
    shp = shape(tie_embeddings=tied)
    want = embedding_params(shp, tp) + shp.l * layer_params(shp, tp) + head_params(shp, tp)
    assert T.megatron_params(shp, tp).numel == want
    if tp == 1:
        assert T.megatron_params(shp, 1).numel == 12 * 3 * 64 ** 2 + 13 * 3 * 64 + \
            (512 + 32) * 64 * (1 if tied else 1) + 2 * 64 + (0 if tied else 512 * 64)


@pytest.mark.parametrize("t", [2, 4, 8])
def test_megatron_layer_traffic_is_the_papers_8bsh(t):
    """Shoeybi et al. / TARGETS.md: 4 all-reduces per layer per micro-batch, 8 b s h (t-1)/t
    elements on the wire (e = 1), 12 b s h (t-1)/t with full recomputation; Korthikanti et
    al.: sequence parallelism moves the same bandwidth, plus (ours, Megatron's) the 2
    backward re-gathers of the column-parallel inputs."""
    b, s, h = 2, 64, 32
    wire = lambda tr: Fraction(summarize(tr)["tp"]["wire_bytes"])  # noqa: E731
    assert wire(T.megatron_layer_traffic(b, s, h, t, e=1)) == Fraction(8 * b * s * h * (t - 1), t)
    assert wire(T.megatron_layer_traffic(b, s, h, t, "full", e=1)) == \
        Fraction(12 * b * s * h * (t - 1), t)
    assert wire(T.megatron_layer_traffic(b, s, h, t, "selective", e=1)) == \
        Fraction(8 * b * s * h * (t - 1), t)
    paper_sp = wire(tp_traffic(b, s, h, t, bytes_per_element=1, sp=True))
    assert paper_sp == Fraction(8 * b * s * h * (t - 1), t)
    assert wire(T.megatron_layer_traffic(b, s, h, t, sp=True, e=1)) == \
        paper_sp + 2 * Fraction(t - 1, t) * b * s * h


def test_megatron_step_adds_the_vocab_parallel_terms():
    shp, b, t, m = shape(), 2, 4, 3
    step = summarize(T.megatron_step_traffic(shp, b, t, m))["tp"]
    S = b * shp.s * shp.h * 4  # noqa: N806
    per_mb = (4 * shp.l + 2) * 2 * Fraction(t - 1, t) * S + \
        3 * 2 * Fraction(t - 1, t) * b * shp.s * 4
    assert Fraction(step["wire_bytes"]) == m * per_mb
    assert step["count"] == m * (4 * shp.l + 2 + 3)
    # sequence parallelism: once per step, the replicated parameters' gradient all-reduce
    sp = T.megatron_step_traffic(shp, b, t, m, sp=True)
    last = [x for x in sp if "once per step" in x.what]
    assert len(last) == 1 and last[0].count == 1
    assert last[0].message_bytes == 4 * (shp.s * shp.h + shp.l * 6 * shp.h + 2 * shp.h)


@pytest.mark.parametrize("q", [2, 3, 4])
def test_summa_rounds_cost_3_q_minus_1_blocks_per_linear(q):
    """Optimus / Tesseract: per linear, 3 SUMMA products of q rounds; with the root visiting
    every rank once a rank sends (q-1) blocks per product: 3 (q-1) (A + B) over row and
    column -- what ``summa_paper_traffic`` states and the per-call records sum to."""
    shp = Shape(vocab_size=61, hidden_size=12 * q, num_layers=2, num_heads=q,
                seq_length=8)
    b, d = q * 2, 1
    tr = G.summa_step_traffic(shp, b, q, d)
    summa = sum(x.exact_wire for x in tr if isinstance(x, T.RootedCycle))
    assert summa == G.summa_paper_traffic(shp, b, q, d)["summa_linears_per_step"]
    cyc = T.RootedCycle("tp_row", "broadcast", q, 100, q)
    assert cyc.exact_wire == (q - 1) * 100


def test_tesseract_depth_all_reduces_every_gradient():
    shp = Shape(vocab_size=61, hidden_size=16, num_layers=1, num_heads=2, seq_length=8)
    tr = G.summa_step_traffic(shp, 8, 2, 2)
    dep = [x for x in tr if x.axis == "tp_dep"]
    assert len(dep) == 1 and dep[0].message_bytes == 4 * G.summa_params(shp, 2).numel
    assert not [x for x in G.summa_step_traffic(shp, 8, 2, 1) if x.axis == "tp_dep"]


def test_3d_linear_costs_two_gathers_and_two_scatters_per_axis():
    """Bian et al.: per linear 2 (q-1) X over the input axis, 2 (q-1) W over x, 2 (q-1)/q Y
    over the output axis (X, W the rank's blocks, Y the partial product)."""
    q = 2
    shp = Shape(vocab_size=61, hidden_size=16, num_layers=1, num_heads=2, seq_length=8,
                ffn_hidden_size=64)
    b = 4
    tr = [x for x in G.cube_step_traffic(shp, b, q) if x.what.startswith("3D 16->48")]
    Tk = b * 8 // (q * q)  # noqa: N806
    X, W, Y = Tk * 16 // q * 4, 16 * 48 // q ** 3 * 4, q * Tk * 48 // q * 4  # noqa: N806
    per_axis = summarize(tr)
    assert per_axis["tp_y"]["wire_bytes"] == 2 * (q - 1) * X
    assert per_axis["tp_x"]["wire_bytes"] == 2 * (q - 1) * W
    assert per_axis["tp_z"]["wire_bytes"] == 2 * (q - 1) * Y / q


def test_grids_refuse_shapes_that_do_not_fit():
    with pytest.raises(ValueError, match="not q\\^2"):
        G.summa_grid(8, 1)
    with pytest.raises(ValueError, match="tp_depth=3 does not divide tp=8"):
        G.summa_grid(8, 3)
    assert G.summa_grid(8, 2) == (2, 2) and G.summa_grid(16, 1) == (4, 1)
    with pytest.raises(ValueError, match="not a cube"):
        G.cube_grid(9)
    assert G.cube_grid(27) == 3
    with pytest.raises(ValueError, match="micro_batch_size"):
        G.check_summa(shape(), 3, 2, 2)


#: the LLaMA blocks (issue 21): 8 query heads over 2 K/V heads, SwiGLU, RMSNorm, no biases
LLAMA = dict(num_kv_heads=2, mlp="swiglu", norm="rmsnorm", bias=False,
             position_embeddings=False)


@pytest.mark.parametrize("kw", [{}, LLAMA, {**LLAMA, "tie_embeddings": True}])
@pytest.mark.parametrize("q", [1, 2])
def test_grid_rank_parameters_sum_to_the_parameter_table(kw, q):
    """Every weight block is one rank's of q^2 (2D) / q^3 (3D); every other parameter is
    split into q hidden blocks, each held by q (2D: the grid rows) / q^2 (3D) ranks, so the
    ranks' replicated elements sum to q / q^2 copies of them: the reference model's count
    (``params.total_params``, the independent table) from the per-rank closed forms."""
    shp = shape(**kw)
    want = total_params(shp)
    s, c = G.summa_params(shp, q), G.cube_params(shp, q)
    assert q * q * (s.numel - s.replicated) + s.replicated * q * q // q == want
    assert q ** 3 * (c.numel - c.replicated) + c.replicated * q ** 3 // (q * q) == want


def test_llama_linears_are_the_gqa_qkv_and_swiglu_fc1():
    """QKV h -> h + 2 g d (64 -> 64 + 2 x 2 x 8), fc1 h -> 2f ([gate; up], 64 -> 512)."""
    whats = {t.what.split(":")[0] for t in G.summa_step_traffic(shape(**LLAMA), 4, 2)}
    assert {"SUMMA 64->96", "SUMMA 64->64", "SUMMA 64->512", "SUMMA 256->64"} <= whats
    assert "SUMMA 64->192" in {t.what.split(":")[0] for t in G.summa_step_traffic(shape(), 4, 2)}


@pytest.mark.parametrize("traffic", [lambda s: G.summa_step_traffic(s, 4, 2, 2, 3),
                                     lambda s: G.cube_step_traffic(s, 4, 2, 3)])
def test_rmsnorm_all_reduces_one_sum_per_token_not_two(traffic):
    """LayerNorm: mean and variance, 2 all-reduces forward and 2 backward per norm; RMSNorm:
    the sum of squares, 1 and 1 -- for 2L + 1 norms, m = 3 micro-batches."""
    def norm_calls(shp):
        return sum(t.count for t in traffic(shp) if "Norm" in t.what)
    assert norm_calls(shape()) == 4 * (2 * 3 + 1) * 3
    assert norm_calls(shape(norm="rmsnorm")) == 2 * (2 * 3 + 1) * 3


def test_3d_without_biases_has_no_y_feature_reduction():
    """The y-feature parameters are QKV's and fc1's biases: without biases no all-reduce
    over z once per step (the norms' and head's all-reduces on z, m = 3 a step, remain)."""
    once = [t for t in G.cube_step_traffic(shape(**LLAMA), 4, 2, 3) if t.count == 1]
    assert {t.axis for t in once} == {"tp_x", "tp_y"}
    once = [t for t in G.cube_step_traffic(shape(), 4, 2, 3) if t.count == 1]
    assert {t.axis for t in once} == {"tp_x", "tp_y", "tp_z"}


def test_grids_keep_each_query_head_with_its_kv_heads():
    """q must divide num_kv_heads: a grid column's query heads' K/V heads are its own."""
    G.check_summa(shape(num_kv_heads=2), 4, 2, 1)
    with pytest.raises(ValueError, match="num_kv_heads=1 is not a multiple of the grid's q=2"):
        G.check_summa(shape(num_kv_heads=1), 4, 2, 1)
    with pytest.raises(ValueError, match="num_kv_heads=2 is not a multiple of the grid's q=4"):
        G.check_cube(shape(num_kv_heads=2, hidden_size=128), 16, 4)


def test_reference_activation_adaptation():
    """The projection input is a view of the attention kernel's output (no selective
    recomputation): one sbh/t e tensor fewer than the count with a copy; Table 2 verbatim is
    recovered by ``layer_activation_bytes`` with 16-bit activations and dropout."""
    s, b, h, a = 64, 2, 32, 4
    for t, sp in ((1, False), (4, False), (4, True)):
        full = reference_layer_activation_bytes(s, b, h, a, t, sp)
        view = reference_layer_activation_bytes(s, b, h, a, t, sp, proj_input_copy=False)
        assert full - view == s * b * h * 4 / t
        for mode in ("selective", "full"):
            assert reference_layer_activation_bytes(s, b, h, a, t, sp, mode) == \
                reference_layer_activation_bytes(s, b, h, a, t, sp, mode,
                                                 proj_input_copy=False)
        for mode in ("none", "selective", "full"):
            got = layer_activation_bytes(s, b, h, a, t, sp, mode)
            paper = korthikanti_layer_bytes(s, b, h, a, t, sp, mode)
            # Table 2 lists 2sbh for full recomputation with or without sequence
            # parallelism; with it the kept layer input is the sequence shard, 2sbh/t
            assert got == (paper / t if mode == "full" and sp else paper)


def test_grid_activation_forms_give_the_measured_bytes():
    # measured on the ranks (tests/equivalence/test_tensor.py asserts equality per case)
    assert G.summa_layer_activation_bytes(16, 2, 32, 4, 2, 1, 128) == 18688
    assert G.summa_layer_activation_bytes(16, 4, 64, 8, 2, 2, 256) == 37248
    assert G.cube_layer_activation_bytes(16, 4, 64, 8, 2, 256) == 102784


def test_grid_activation_forms_of_the_llama_blocks_give_the_measured_bytes():
    """Measured on the ranks (llama-tiny rows; test_tensor_llama asserts equality per
    case). 2D, T = 16 tokens, h/q = 16, f/q = 32, 2 of 4 query heads over 1 of 2 K/V heads:
    two RMSNorms 2 (2 T h/q e + 4 T) = 4224; QKV and fc1 inputs 2 T h/q e = 2048; rotated q,
    repeated k and v, the output 4 T h/q e = 4096, log-sum-exp 4 T a/q = 128, RoPE's cos and
    sin for q and k 4 s d 4 = 2048; SwiGLU's [gate; up], silu(gate), product 4 T f/q e =
    8192: 20736."""
    llama = {"kv_heads": 2, "rope": True, "swiglu": True}
    assert G.summa_layer_activation_bytes(16, 2, 32, 4, 2, 1, 64, **llama) == 20736
    assert G.summa_layer_activation_bytes(16, 4, 64, 8, 2, 2, 64, **llama) == 31104
    assert G.cube_layer_activation_bytes(16, 4, 64, 8, 2, 64, **llama) == 63872
    # RoPE on multi-head attention: v stays a view of QKV's output, kept whole
    assert G.summa_layer_activation_bytes(16, 2, 32, 4, 2, 1, 64, kv_heads=4, rope=True,
                                          swiglu=True) == 22784
    # packed documents: a rank's one sample (T = s = 16) keeps its own tables (as many as
    # the shared ones at one sample) and the kernel's fp32 mask 4 x 16 x 16 = 1024; two
    # samples (b = 4, T = 32): twice the tokens' terms, tables 2 x 2048, masks 2 x 1024
    assert G.summa_layer_activation_bytes(16, 2, 32, 4, 2, 1, 64, packed=True,
                                          **llama) == 20736 + 1024
    assert G.summa_layer_activation_bytes(16, 4, 32, 4, 2, 1, 64, packed=True,
                                          **llama) == 2 * (20736 - 2048) + 2 * 2048 + 2 * 1024


def test_estimate_prints_per_layer_traffic_and_activations():
    est = estimate(shape(seq_length=64), Layout(tp=4, cp=2, micro_batch_size=1),
                   Options().with_values(sp=True, recompute="selective"))
    per = est.communication.per_layer
    assert {"tp", "tp_sp", "paper_tp_sp", "cp_ring", "ulysses", "cp_allgather"} <= set(per)
    assert per["tp"]["tp"]["wire_bytes"] == per["paper_tp_sp"]["tp"]["wire_bytes"]
    acts = est.memory.activations.per_layer_by_recompute
    assert acts["full"]["korthikanti"] < acts["selective"]["korthikanti"] < \
        acts["none"]["korthikanti"]
