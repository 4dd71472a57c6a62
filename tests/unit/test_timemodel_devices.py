"""The device presets and the uncalibrated GEMM / attention pricing (issue 22, sec. 1): the
wave model's definition, the memory roofline, unfused attention, and the presets' sources."""
from __future__ import annotations

import math

import pytest

from parbench.timemodel import PRESETS, load_profile
from parbench.timemodel.profile import GEMM_TILES, wave_efficiency

SMS = 108


@pytest.mark.parametrize("waves", [1, 2, 5])
def test_an_output_of_whole_waves_fills_every_sm(waves):
    """128 x 128 tiles, waves x SMs of them: nothing idle, nothing wasted."""
    assert wave_efficiency(128, 128 * SMS * waves, SMS) == 1.0


def test_one_tile_past_a_wave_leaves_most_of_the_last_wave_idle():
    """The 128 x 128 tile count for one more column of tiles than a full wave; no tile shape
    of GEMM_TILES can do better than every tile slot of the waves it needs."""
    n = 128 * (SMS + 1)
    eff = wave_efficiency(128, n, SMS)
    assert eff < 1.0
    for tm, tn in GEMM_TILES:
        tiles = math.ceil(128 / tm) * math.ceil(n / tn)
        assert eff >= (128 * n) / (tm * tn) / (math.ceil(tiles / SMS) * SMS) - 1e-12


def test_no_wave_model_without_an_sm_count():
    assert wave_efficiency(7, 13, 0) == 1.0


def test_a_skinny_gemm_is_memory_bound_and_a_large_one_compute_bound():
    a100 = load_profile("a100-80gb")
    # one row: 2 (k + k n + n) bytes over the bandwidth, far above its FLOPs' time
    k = n = 8192
    t = a100.shaped_gemm_time(1, n, k, "bf16")
    assert t == pytest.approx(2 * (k + k * n + n) / a100.mem_bandwidth)
    # a large square GEMM: no faster than the achievable rate, slower than the peak
    m = 8192
    big = a100.shaped_gemm_time(m, m, m, "bf16")
    assert big >= 2 * m ** 3 / a100.matmul_achievable["bf16"]
    assert big > 2 * m ** 3 / a100.peak_flops("bf16")


def test_unfused_attention_computes_every_score_and_moves_them_through_memory():
    """Megatron's attention before flash: no causal skipping, the scores' bytes priced."""
    a100 = load_profile("a100-80gb")
    b, heads, s, d = 1, 12, 2048, 128
    ff, fb = a100.attention_time(b, heads, s, s, d, "bf16", True, True)
    uf, ub = a100.attention_time(b, heads, s, s, d, "bf16", True, False)
    scores = b * heads * s * s
    rate = a100.matmul_achievable["bf16"]
    assert ff == pytest.approx(0.5 * 4 * scores * d / rate)
    assert uf == pytest.approx(4 * scores * d / rate + 13 * scores / a100.mem_bandwidth)
    # backward: dP written, P read for dV, dropout's gradient (read, mask, write), the
    # softmax's (gradient and output read, written), dS read by dQ's and by dK's GEMM:
    # 2 + 2 + 5 + 6 + 2 + 2 = 19 bytes a score in 16-bit
    assert ub == pytest.approx(2 * 4 * scores * d / rate + 19 * scores / a100.mem_bandwidth)
    assert uf > ff


@pytest.mark.parametrize("name", ["a100-40gb", "a100-80gb", "h100-80gb", "h200-141gb",
                                  "b200-180gb"])
def test_every_generation_has_a_preset_with_its_sources(name):
    prof = PRESETS[name]
    assert 0 < prof.matmul_achievable["bf16"] < prof.matmul_flops["bf16"]
    assert prof.sm_count > 0 and prof.memory_bytes > 0 and prof.mem_bandwidth > 0
    for needle in ("datasheet", "Maximum Achievable Matmul", "nccl#1054"):
        assert needle in prof.source


def test_the_cuda11_a100_prices_gemms_and_elementwise_kernels_at_their_measured_rates():
    """``a100-80gb-cuda11``: the 80GB preset with Mu Li's transformers-benchmarks figures
    (CUDA 11.7): FP16 matmul 230 TFLOP/s; ``a * 1.2`` on fp32 vectors 0.202 TFLOP/s, 8
    bytes moved per FLOP; everything else as ``a100-80gb``."""
    old, era = load_profile("a100-80gb"), load_profile("a100-80gb-cuda11")
    assert era.matmul_achievable == {"bf16": 230e12, "fp16": 230e12}
    assert era.mem_bandwidth == pytest.approx(8 * 0.202e12)
    assert era.matmul_flops == old.matmul_flops and era.links == old.links
    assert era.memory_bytes == old.memory_bytes and era.sm_count == old.sm_count
    assert "transformers-benchmarks" in era.source and "datasheet" in era.source
    m = 8192
    assert era.shaped_gemm_time(m, m, m, "fp16") == pytest.approx(
        old.shaped_gemm_time(m, m, m, "fp16") * 271.2 / 230)


def test_b200_alias_and_40gb_memory():
    assert load_profile("b200").name == "b200-180gb"
    assert load_profile("a100-40gb").mem_bandwidth < load_profile("a100-80gb").mem_bandwidth


def test_a_16_bit_runs_optimizer_step_adds_the_mixed_precision_passes():
    """On a preset the optimizer step is bytes over the memory bandwidth, each parameter of
    the rank: AdamW's 32 bytes (fp32), plus in a 16-bit run Megatron-LM's mixed-precision
    passes -- the 16-bit gradient read and the fp32 main gradient written (2 + 4), the norm
    read (4), the master weight read and written back as the 16-bit weight (4 + 2) -- and in
    fp16 the loss scaler's unscale (4 + 4): 32, 48 and 56 bytes."""
    from parbench.analytic.shape import Shape
    from parbench.timemodel import Training, predict_step
    v, h, l, s = 1024, 256, 2, 128  # noqa: E741
    shape = Shape(vocab_size=v, hidden_size=h, num_layers=l, num_heads=4, seq_length=s,
                  tie_embeddings=True)
    # tied token embedding, positions, per layer 4h^2 + 8h^2 weights and 13h biases and
    # LayerNorms, the final LayerNorm
    psi = v * h + s * h + l * (12 * h * h + 13 * h) + 2 * h
    prof = load_profile("a100-80gb")
    opt = {dt: predict_step(shape, Training.of(dtype=dt), prof).breakdown["optimizer_s"]
           for dt in ("fp32", "bf16", "fp16")}
    for dt, nbytes in (("fp32", 32), ("bf16", 48), ("fp16", 56)):
        assert opt[dt] == pytest.approx(nbytes * psi / 1.80e12, rel=1e-9)


def test_preset_latencies_are_nccls_ring_simple_model():
    """NCCL's tuning model (src/graph/tuning.cc): a ring collective with the Simple protocol
    costs baseLat 8.4 us plus hwLat 3.4 us a step over NVLink, 9.6 us between nodes: an
    all-gather on 8 GPUs of a node, 7 steps, 8.4 + 7 x 3.4 us before its bytes."""
    a100 = load_profile("a100-80gb")
    intra, inter = a100.links["intra"], a100.links["inter"]
    assert (intra.base_latency_s, intra.latency_s) == pytest.approx((8.4e-6, 3.4e-6))
    assert (inter.base_latency_s, inter.latency_s) == pytest.approx((8.4e-6, 9.6e-6))
    assert a100.collective_time("all_gather", 8, 0.0, "intra") == pytest.approx(
        8.4e-6 + 7 * 3.4e-6)
    assert "tuning.cc" in a100.source
