"""torchtitan's own Llama 3 model (``torchtitan.models.llama3.Llama3Model``, torchtitan 0.3.0)
built for a parbench case, and the reference model's weights copied into it.

The model config is assembled as torchtitan's ``llama3`` presets assemble theirs
(``_build_llama3_layers``: RMSNorm, grouped-query attention with separate wq/wk/wv, SwiGLU
``w2(silu(w1 x) * w3 x)``, ``ComplexRoPE`` without frequency scaling), with the case's sizes:
dim, layers, heads, K/V heads, the FFN hidden size set directly, vocabulary, rope theta,
norm epsilon (parbench's ``NORM_EPS``), no bias.

Two deviations from torchtitan's defaults, both because this runs on CPU:
the inner attention is torchtitan's ``ScaledDotProductAttention`` (causal SDPA) instead of
FlexAttention, whose backward torch does not implement on CPU (torchtitan 0.3.0's
``get_attention_config`` refuses "sdpa" for language models; the module itself is kept).

RoPE conventions differ: torchtitan rotates interleaved pairs (2j, 2j+1) as complex numbers
(``freqs_cis``, Meta's llama reference), parbench's reference rotates the halves (j, j + d/2,
the HF / Megatron-Core layout), both with frequency theta^(-2j/d). The two compute the same
function when each Q and K head's rows are permuted so that titan row 2j is reference row j
and row 2j+1 is reference row j + d/2 -- the inverse of the permutation HF's
``convert_llama_weights_to_hf.py`` applies to Meta's checkpoints.
"""
from __future__ import annotations

import torch

from parbench.model.blocks import NORM_EPS


def titan_config(cfg):
    """torchtitan's ``Llama3Model.Config`` for parbench model config ``cfg``."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers
    h, v = cfg.hidden_size, cfg.vocab_size
    rope = ComplexRoPE.Config(dim=cfg.head_dim, max_seq_len=cfg.seq_length,
                              theta=cfg.rope_theta, scaling="none")
    layers = _build_llama3_layers(n_layers=cfg.num_layers, dim=h, n_heads=cfg.num_heads,
                                  n_kv_heads=cfg.num_kv_heads or cfg.num_heads,
                                  hidden_dim=cfg.ffn, fuse_qkv=False, rope=rope,
                                  attn_backend="flex")
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
        layer.attention_norm.eps = layer.ffn_norm.eps = NORM_EPS
    return Llama3Model.Config(
        dim=h, vocab_size=v,
        tok_embeddings=Embedding.Config(num_embeddings=v, embedding_dim=h),
        norm=RMSNorm.Config(normalized_shape=h, eps=NORM_EPS),
        lm_head=Linear.Config(in_features=h, out_features=v),
        layers=layers)


def rope_rows(num_heads: int, head_dim: int) -> torch.Tensor:
    """Index ``idx`` with ``titan_rows = reference_rows[idx]`` for a Q or K projection of
    ``num_heads`` heads: per head, (j, j + d/2) -> (2j, 2j + 1)."""
    half = torch.arange(head_dim // 2)
    one = torch.stack([half, half + head_dim // 2], dim=-1).flatten()
    return torch.cat([one + i * head_dim for i in range(num_heads)])


def name_map(cfg) -> dict[str, str]:
    """parbench parameter name -> torchtitan parameter name (fc1 maps to w1 and w3 and the
    fused QKV to wq, wk, wv: see ``to_titan``)."""
    out = {"embed.tok.weight": "tok_embeddings.weight", "head.ln.weight": "norm.weight",
           "head.out.weight": "lm_head.weight"}
    for i in range(cfg.num_layers):
        ours, theirs = f"blocks.{i}", f"layers.{i}"
        out.update({f"{ours}.ln1.weight": f"{theirs}.attention_norm.weight",
                    f"{ours}.ln2.weight": f"{theirs}.ffn_norm.weight",
                    f"{ours}.attn.proj.weight": f"{theirs}.attention.wo.weight",
                    f"{ours}.mlp.fc2.weight": f"{theirs}.feed_forward.w2.weight"})
    return out


def to_titan(cfg, ref: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The reference model's parameters ``ref`` (parbench names) as torchtitan's."""
    nq, nkv, d = cfg.num_heads, cfg.num_kv_heads or cfg.num_heads, cfg.head_dim
    out = {theirs: ref[ours] for ours, theirs in name_map(cfg).items()}
    for i in range(cfg.num_layers):
        q, k, v = ref[f"blocks.{i}.attn.qkv.weight"].split([nq * d, nkv * d, nkv * d])
        gate, up = ref[f"blocks.{i}.mlp.fc1.weight"].chunk(2)
        pre = f"layers.{i}"
        out.update({f"{pre}.attention.qkv_linear.wq.weight": q[rope_rows(nq, d)],
                    f"{pre}.attention.qkv_linear.wk.weight": k[rope_rows(nkv, d)],
                    f"{pre}.attention.qkv_linear.wv.weight": v,
                    f"{pre}.feed_forward.w1.weight": gate,
                    f"{pre}.feed_forward.w3.weight": up})
    return out


def from_titan(cfg, titan: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """torchtitan's parameters (or gradients) ``titan`` back under parbench's names and
    layout (the inverse of ``to_titan``); a pipeline stage's subset maps to its subset."""
    nq, nkv, d = cfg.num_heads, cfg.num_kv_heads or cfg.num_heads, cfg.head_dim
    out = {ours: titan[theirs] for ours, theirs in name_map(cfg).items() if theirs in titan}
    for i in range(cfg.num_layers):
        pre = f"layers.{i}.attention.qkv_linear"
        if f"{pre}.wq.weight" not in titan:
            continue  # the layer is on another stage
        q, k = (torch.empty_like(titan[f"{pre}.w{n}.weight"]) for n in "qk")
        q[rope_rows(nq, d)] = titan[f"{pre}.wq.weight"]
        k[rope_rows(nkv, d)] = titan[f"{pre}.wk.weight"]
        out[f"blocks.{i}.attn.qkv.weight"] = torch.cat([q, k, titan[f"{pre}.wv.weight"]])
        ff = f"layers.{i}.feed_forward"
        out[f"blocks.{i}.mlp.fc1.weight"] = torch.cat([titan[f"{ff}.w1.weight"],
                                                       titan[f"{ff}.w3.weight"]])
    return out
