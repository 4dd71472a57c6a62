"""The activation formula on the LLaMA blocks (issue 21): the per-feature terms of
``analytic.activations`` by hand, the per-layer count of each family's layout by hand, and the
reference model's saved tensors (``SavedActivations`` around one ``Block``, one process)
equal to the formula for every combination of the features."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from parbench.analytic.activations import (mlp_saved_elements, norm_saved_bytes,
                                           packed_mask_bytes, qkv_saved_elements,
                                           reference_block_keywords,
                                           reference_layer_activation_bytes, rope_table_bytes)
from parbench.analytic.context import cp_block_keywords, cp_layer_activation_bytes
from parbench.config import ModelConfig
from parbench.memory import SavedActivations
from parbench.model.gpt import Block
from parbench.model.packing import documents_of, eod_token
from parbench.presets import PRESETS

LLAMA = ModelConfig(name="llama-tiny", **PRESETS["llama-tiny"])  # h 32, a 4, g 2, f 64, s 16


def test_qkv_terms_by_hand():
    """T = 10 tokens, h = 8, kv = 4: GPT-2's q, k, v are views of the QKV output, 16 per
    token; RoPE makes q (8) and k (4) their own and v keeps the output (16): 28; a repeat
    makes k and v their own at h (8 + 8), q keeps the output: 32; both: 8 + 8 + 8 = 24; a
    kernel that copies keeps 16 whatever came before."""
    assert qkv_saved_elements(10, 8, 4) == 160
    assert qkv_saved_elements(10, 8, 4, rope=True) == 280
    assert qkv_saved_elements(10, 8, 4, repeat=True) == 320
    assert qkv_saved_elements(10, 8, 4, rope=True, repeat=True) == 240
    assert qkv_saved_elements(10, 8, 4, rope=True, repeat=True, copies=True) == 160


def test_rope_mlp_and_norm_terms_by_hand():
    """cos and sin for q and k, 16 rows x d = 8 fp32: 4 x 512 B; a packed mask of 2 samples
    2 x 16 x 16 fp32; SwiGLU's [gate; up] 2f, silu f, product f; torch's norms on T = 32
    rows of h = 32 fp32: LayerNorm input 4096 B + mean and 1/sigma 2 x 128 B; RMSNorm input
    and normalised input 2 x 4096 B + 1/rms 128 B."""
    assert rope_table_bytes(16, 8) == 2048
    assert packed_mask_bytes(2, 16) == 2 * 16 * 16 * 4
    assert mlp_saved_elements(64) == 128 and mlp_saved_elements(64, "gelu", False) == 64
    assert mlp_saved_elements(64, "swiglu") == 256
    assert mlp_saved_elements(64, "swiglu", False) == 192
    assert norm_saved_bytes(32, 32) == 4352 and norm_saved_bytes(32, 32, "rmsnorm") == 8320
    with pytest.raises(ValueError, match="norm='batchnorm'"):
        norm_saved_bytes(1, 1, "batchnorm")
    with pytest.raises(ValueError, match="mlp='relu'"):
        mlp_saved_elements(1, "relu")


def test_megatron_layouts_by_hand():
    """llama-tiny, b = 2 (T = 32 tokens, T h e = 4096 B). Two RMSNorms 2 (8192 + 128) =
    16640 and the QKV and fc1 inputs 8192, / t under sp; SwiGLU 4 T f e / t = 32768 / t.
    tp = 2 (1 K/V head per rank, repeated to its 2 query heads): rotated q, repeated k and
    v, the output 4 x 2048, log-sum-exp T a/t 4 = 256, the tables 2048: 10496 ->
    51712 (39296 with sp). tp = 4 > g = 2: a rank's one query head and its group's K/V
    head, no repeat: rotated q and k 2 x 1024, v a view of the rank's gathered
    [q; k; v] (T 3 d e = 3072), output 1024, lse 128, tables 2048: 8320 -> 41344 (22720
    with sp). Selective at tp = 2, g = 1 (RoPE and repeat recomputed with the core): the
    rank's [q; k; v] T 4 d e = 4096 and the projection input 2048 -> 47360."""
    def megatron(tp, sp=False, recompute="none", **ov):
        m = dataclasses.replace(LLAMA, **ov)
        return reference_layer_activation_bytes(
            16, 2, 32, 4, tp, sp, recompute, 64, 4, False,
            **reference_block_keywords(m, tp, 2))
    assert megatron(2) == 51712 and megatron(2, sp=True) == 39296
    assert megatron(4) == 41344 and megatron(4, sp=True) == 22720
    assert megatron(2, recompute="selective", num_kv_heads=1) == 47360
    assert megatron(2, recompute="full") == 16 * 2 * 32 * 4


def test_context_layouts_by_hand():
    """llama-tiny on a cp = 2 rank, b = 1 (T = 8, T h e = 1024 B): RMSNorms 2 (2048 + 32),
    QKV and fc1 inputs 2048, the core's own q, k, v (32 + 16 + 16) T e = 2048, its output and
    the projection's input 2 x 1024, lse 128, tables 4 x 8 x 8 x 4 = 1024, SwiGLU 8192:
    19648. Selective (the core checkpointed after RoPE): its inputs, rotated q 1024 and k 512
    and the QKV output 2048 that v views, and the projection input 1024 instead of the
    copies, output and lse: 20032. Packed b = 2: the tables per sample, 2 x 1024 more. RSA
    on cp = 4 (T = 4, a = 8, d = 4, g = 2): the kernel's output and lse (512 + 128) give
    way to the score rows a (s/cp) s e = 2048: 10784."""
    kw = cp_block_keywords(LLAMA, 8, 1)
    assert cp_layer_activation_bytes("ring-attention", 16, 1, 32, 4, 2, ffn_hidden=64,
                                     blocks=kw) == 19648
    assert cp_layer_activation_bytes("ring-attention", 16, 1, 32, 4, 2, "selective", 64,
                                     blocks=kw) == 20032
    packed = cp_block_keywords(dataclasses.replace(LLAMA, pack_docs=3), 8, 2)
    assert cp_layer_activation_bytes("ring-attention", 16, 2, 32, 4, 2, ffn_hidden=64,
                                     blocks=packed) == 2 * 19648 - 2 * 1024 + 2 * 1024
    rsa = dataclasses.replace(LLAMA, num_heads=8)
    assert cp_layer_activation_bytes("ring-self-attention", 16, 1, 32, 8, 4, ffn_hidden=64,
                                     blocks=cp_block_keywords(rsa, 4, 1)) == 10784


VARIANTS = [{}, {"norm": "layernorm"}, {"rope_theta": 0.0}, {"num_kv_heads": 4},
            {"num_kv_heads": 1}, {"mlp": "gelu"}, {"pack_docs": 3},
            {"norm": "layernorm", "rope_theta": 0.0, "num_kv_heads": 4, "mlp": "gelu",
             "bias": True}]


@pytest.mark.parametrize("ov", VARIANTS, ids=lambda ov: ",".join(ov) or "llama")
def test_the_reference_block_keeps_what_the_formula_counts(ov):
    """One reference ``Block`` (b = 2, s = 16) under saved-tensor hooks: each storage it keeps
    for backward, weights left out, equals the formula at the model's keywords (the heads
    merged by a view: ``proj_input_copy=False``) -- LLaMA-tiny, each feature off in turn,
    GQA at 1 K/V head, packed documents (per-sample RoPE tables, the kernel's mask) and
    GPT-2's blocks."""
    m = dataclasses.replace(LLAMA, **ov)
    torch.manual_seed(0)
    blk = Block(m)
    x = torch.randn(2, m.seq_length, m.hidden_size, requires_grad=True)
    tokens = torch.randint(0, m.vocab_size, (2, m.seq_length))
    tokens[:, 5] = eod_token(m)
    more = (documents_of(m, tokens),) if m.pack_docs else ()
    with SavedActivations(exclude=list(blk.parameters())) as saved:
        blk(x, *more)
    assert saved.bytes == reference_layer_activation_bytes(
        m.seq_length, 2, m.hidden_size, m.num_heads, ffn_hidden=m.ffn, proj_input_copy=False,
        **reference_block_keywords(m, 1, 2))
