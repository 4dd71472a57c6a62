"""The model presets (``model=NAME``): published shapes, each with its source, and the
small runnable ones. Pure data; ``config.model_preset`` builds a ``ModelConfig`` from one."""
from __future__ import annotations

from typing import Any

#: Named model shapes. Tiny ones run on local CPU ranks; real ones feed the analytic model.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=128, hidden_size=32, num_layers=2, num_heads=4, seq_length=16),
    "tiny-4l": dict(vocab_size=128, hidden_size=32, num_layers=4, num_heads=4, seq_length=16),
    "tiny-8l": dict(vocab_size=128, hidden_size=32, num_layers=8, num_heads=4, seq_length=16),
    "small": dict(vocab_size=512, hidden_size=128, num_layers=4, num_heads=8, seq_length=64),
    "bench": dict(vocab_size=1024, hidden_size=256, num_layers=8, num_heads=8, seq_length=128),
    # Brown et al. 2020, Table 2.1; vocabulary 50257 padded to 51200 as Megatron pads it
    # (a multiple of 128 * tp) so vocab-parallel layers split evenly
    "gpt3-175b": dict(vocab_size=51200, hidden_size=12288, num_layers=96, num_heads=96,
                      seq_length=2048, tie_embeddings=True),
    # Touvron et al. 2023, "Llama 2" (arXiv 2307.09288), Sec. 2.2 and Table 1, and Meta's
    # released config.json (params.json): RMSNorm, SwiGLU with ffn 11008 / 28672, RoPE (no
    # learned positions), no biases, untied head, vocabulary 32000, context 4096; grouped-query
    # attention with 8 KV heads for 70B (Table 1: GQA for 34B and 70B). Parameters:
    # 6,738,415,616 and 68,976,648,192 (analytic.params) -- Meta's "7B" and "70B". Analytic
    # only (the reference model is GPT-2 style); the vocabulary is padded to a multiple of
    # 128 x tp as Megatron-LM pads it (32000 at tp = 1, 32768 at tp = 8).
    "llama2-7b": dict(vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32,
                      ffn_hidden_size=11008, seq_length=4096, position_embeddings=False,
                      mlp="swiglu", norm="rmsnorm", bias=False,
                      make_vocab_size_divisible_by=128),
    "llama2-70b": dict(vocab_size=32000, hidden_size=8192, num_layers=80, num_heads=64,
                       num_kv_heads=8, ffn_hidden_size=28672, seq_length=4096,
                       position_embeddings=False, mlp="swiglu", norm="rmsnorm", bias=False,
                       make_vocab_size_divisible_by=128),
    # LLaMA-3 (Dubey et al. 2024, "The Llama 3 Herd of Models", Table 3; Meta's released
    # config.json): RoPE with theta 500000, GQA with 8 KV heads, SwiGLU, RMSNorm, no biases,
    # untied head, vocabulary 128256, context 8192. Parameters 8,030,261,248 /
    # 70,553,706,496 / 405,853,388,800 (the model cards' 8.03B, 70.6B, 405.9B). Analytic
    # (too large to run here); ``llama-tiny`` is the runnable model of the same blocks.
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32,
                      num_kv_heads=8, ffn_hidden_size=14336, seq_length=8192,
                      position_embeddings=False, rope_theta=500000.0, mlp="swiglu",
                      norm="rmsnorm", bias=False),
    "llama3-70b": dict(vocab_size=128256, hidden_size=8192, num_layers=80, num_heads=64,
                       num_kv_heads=8, ffn_hidden_size=28672, seq_length=8192,
                       position_embeddings=False, rope_theta=500000.0, mlp="swiglu",
                       norm="rmsnorm", bias=False),
    "llama3-405b": dict(vocab_size=128256, hidden_size=16384, num_layers=126, num_heads=128,
                        num_kv_heads=8, ffn_hidden_size=53248, seq_length=8192,
                        position_embeddings=False, rope_theta=500000.0, mlp="swiglu",
                        norm="rmsnorm", bias=False),
    # the LLaMA-3 blocks at the size of ``tiny``: 4 query heads sharing 2 K/V heads
    "llama-tiny": dict(vocab_size=128, hidden_size=32, num_layers=2, num_heads=4,
                       num_kv_heads=2, ffn_hidden_size=64, seq_length=16,
                       position_embeddings=False, rope_theta=500000.0, mlp="swiglu",
                       norm="rmsnorm", bias=False),
    # DeepSeek-V3's MoE blocks (DeepSeek-AI 2024, arXiv 2412.19437, Sec. 2.1.2 and 4.2) at the
    # size of ``tiny``: 3 layers, the first dense (first_k_dense_replace); then 8 fine-grained
    # routed experts of a quarter of the dense MLP (16 vs 64), top-2, and one shared expert of
    # the same size; the sigmoid router with the auxiliary-loss-free bias (gamma 0.001, the
    # report's value), group-limited routing over 2 groups of 4 keeping 1 (the report's
    # top-2-sum group score and Megatron-Core's top-k/topk_groups one agree at k = 2), a
    # small balancing loss (alpha 0.0001) and no token dropped (capacity factor 0). RoPE and
    # RMSNorm; GELU experts with biases (the routing is what this preset exercises; SwiGLU
    # experts without biases are mixtral-tiny's; MHA, not MLA).
    "deepseek-tiny": dict(vocab_size=128, hidden_size=32, num_layers=3, num_heads=4,
                          ffn_hidden_size=64, seq_length=16, num_experts=8, moe_top_k=2,
                          moe_ffn_hidden_size=16, moe_shared_expert_size=16,
                          moe_first_dense=1, moe_router="sigmoid", moe_bias_update_rate=0.001,
                          moe_router_groups=2, moe_router_topk_groups=1,
                          moe_aux_loss_coef=0.0001, moe_capacity_factor=0.0,
                          position_embeddings=False, rope_theta=10000.0, norm="rmsnorm"),
    # Mixtral's MoE blocks (Jiang et al. 2024, Table 1) at the size of ``llama-tiny``: every
    # layer MoE, 8 SwiGLU experts of the dense MLP's width, top-2 softmax routing, GQA (4
    # query heads over 2 K/V heads), RoPE (theta 1e6), RMSNorm, no biases, untied head; no
    # token dropped (capacity factor 0) and the balancing loss at Switch Transformer's alpha
    # 0.01 (Fedus et al. 2021, Sec. 2.2; the paper does not print its own). Runnable.
    "mixtral-tiny": dict(vocab_size=128, hidden_size=32, num_layers=2, num_heads=4,
                         num_kv_heads=2, ffn_hidden_size=64, seq_length=16, num_experts=8,
                         moe_top_k=2, moe_capacity_factor=0.0, moe_aux_loss_coef=0.01,
                         position_embeddings=False, rope_theta=1e6, mlp="swiglu",
                         norm="rmsnorm", bias=False),
    # Multi-head latent attention (DeepSeek-V2 Sec. 2.1) at the size of ``llama-tiny``: a
    # 16-wide K/V latent, a 12-wide query latent, heads of 8 + 4 rotary (query / key) and 8
    # (value); RoPE on the decoupled parts, RMSNorm, SwiGLU, no biases. Runnable.
    "mla-tiny": dict(vocab_size=128, hidden_size=32, num_layers=2, num_heads=4,
                     ffn_hidden_size=64, seq_length=16, position_embeddings=False,
                     rope_theta=10000.0, mlp="swiglu", norm="rmsnorm", bias=False,
                     kv_lora_rank=16, q_lora_rank=12, qk_head_dim=8, qk_rope_head_dim=4,
                     v_head_dim=8),
    # DeepSeek-V3's architecture (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", arXiv
    # 2412.19437, Sec. 2.1 and 4.2) at the size of ``mla-tiny``: multi-head latent attention
    # (Sec. 2.1.1, Eqs. 1-11: mla-tiny's latents and heads), the first layer dense
    # (first_k_dense_replace), then DeepSeekMoE (Sec. 2.1.2, Eqs. 12-16): 8 fine-grained
    # SwiGLU experts of 16 (a quarter of the dense 64), top-2, one shared expert of 16, the
    # sigmoid router with the auxiliary-loss-free bias (gamma 0.001), group-limited routing
    # over 2 groups of 4 keeping 1 (k = 2 topk_groups, as the report's 8 of 4 groups), the
    # routed gates normalised then scaled by 2.5 (the released routed_scaling_factor);
    # RMSNorm, no biases, untied head, no token dropped. No balancing loss: the report's
    # complementary loss is sequence-wise (Eqs. 17-20, alpha "extremely small"), not
    # parbench's per-group loss. Runnable: the reference model combines MLA and the MoE
    # (the expert family, hybrid at cp = 1, baseline.torchtitan.deepseek-v3 run it).
    "deepseek-v3-tiny": dict(vocab_size=128, hidden_size=32, num_layers=3, num_heads=4,
                             ffn_hidden_size=64, seq_length=16, position_embeddings=False,
                             rope_theta=10000.0, mlp="swiglu", norm="rmsnorm", bias=False,
                             kv_lora_rank=16, q_lora_rank=12, qk_head_dim=8,
                             qk_rope_head_dim=4, v_head_dim=8, num_experts=8, moe_top_k=2,
                             moe_ffn_hidden_size=16, moe_shared_expert_size=16,
                             moe_first_dense=1, moe_router="sigmoid",
                             moe_bias_update_rate=0.001, moe_router_groups=2,
                             moe_router_topk_groups=1, moe_router_scaling=2.5,
                             moe_aux_loss_coef=0.0, moe_capacity_factor=0.0),
    # Mixtral (Jiang et al. 2024, "Mixtral of Experts", Table 1; Mistral AI's released
    # config.json): 8 SwiGLU experts per layer, top-2, every layer MoE, GQA with 8 KV heads,
    # RoPE (theta 1e6), RMSNorm, no biases, untied head. 8x7B: 32 layers of 4096, experts of
    # 14336, vocabulary 32000 -- 46,702,792,704 parameters, 12,879,925,248 active (the paper's
    # "47B" and "13B"). 8x22B: 56 layers of 6144 (48 heads), experts of 16384, vocabulary
    # 32768 -- Mistral's "141B, 39B active". Analytic only.
    "mixtral-8x7b": dict(vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32,
                         num_kv_heads=8, ffn_hidden_size=14336, seq_length=4096,
                         num_experts=8, moe_top_k=2, position_embeddings=False,
                         rope_theta=1000000.0, mlp="swiglu", norm="rmsnorm", bias=False),
    "mixtral-8x22b": dict(vocab_size=32768, hidden_size=6144, num_layers=56, num_heads=48,
                          num_kv_heads=8, ffn_hidden_size=16384, seq_length=4096,
                          num_experts=8, moe_top_k=2, position_embeddings=False,
                          rope_theta=1000000.0, mlp="swiglu", norm="rmsnorm", bias=False),
    # DeepSeekMoE 16B (Dai et al. 2024, "DeepSeekMoE: Towards Ultimate Expert Specialization
    # in Mixture-of-Experts Language Models", Sec. 5; the released config.json): 28 layers of
    # 2048, the first dense (ffn 10944), then 64 fine-grained routed experts of 1408, top-6,
    # and 2 shared experts (2 x 1408) on every MoE layer; MHA with 16 heads, SwiGLU, RMSNorm,
    # no biases, untied head, vocabulary 102400. 16,375,728,128 parameters, 2,828,650,496
    # active (the paper's "16.4B" and "2.8B"). Analytic only (fine-grained and shared experts).
    "deepseek-moe-16b": dict(vocab_size=102400, hidden_size=2048, num_layers=28, num_heads=16,
                             ffn_hidden_size=10944, seq_length=4096, num_experts=64,
                             moe_top_k=6, moe_ffn_hidden_size=1408,
                             moe_shared_expert_size=2816, moe_first_dense=1,
                             position_embeddings=False, rope_theta=10000.0, mlp="swiglu",
                             norm="rmsnorm", bias=False),
    # DeepSeek-V3 (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", Sec. 4.2; the released
    # config.json): 61 layers of 7168, the first 3 dense (ffn 18432), then 256 routed experts
    # of 2048, top-8, and one shared expert of 2048; multi-head latent attention with 128
    # heads (query latent 1536, K/V latent 512, query/key heads 128 + 64 rotary, values
    # 128); SwiGLU, RMSNorm, no biases, untied head, vocabulary 129280. 671,026,404,352
    # parameters, 37,552,282,624 active (the report's "671B" and "37B"; without the
    # multi-token-prediction module, and without the 256 router-bias values a layer that
    # select experts only). Analytic only. Routing is priced as top-8 of 256 (the report's
    # sigmoid gate, node-limited routing and bias left at their defaults here; the reference
    # model runs them: ``deepseek-tiny``).
    "deepseek-v3": dict(vocab_size=129280, hidden_size=7168, num_layers=61, num_heads=128,
                        ffn_hidden_size=18432, seq_length=4096, num_experts=256, moe_top_k=8,
                        moe_ffn_hidden_size=2048, moe_shared_expert_size=2048,
                        moe_first_dense=3, kv_lora_rank=512, q_lora_rank=1536,
                        qk_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                        position_embeddings=False, rope_theta=10000.0, mlp="swiglu",
                        norm="rmsnorm", bias=False),
    # UB-Mesh (arXiv 2503.20377) Table 5 "GPT4-2T"-like MoE: 96 layers, 96 heads of 128,
    # hidden 12288, 16 experts (sourced); top-1 and 8192 tokens per context-parallel rank
    # are inferred from Table 1 (analytic.traffic.UBMeshMoE2T). seq_length is the whole
    # sequence, split over cp: 8192 x cp 16 = 131072, so that `parbench estimate
    # model=ubmesh-moe-2t tp=16 cp=16 ep=8 pp=3 dp=4 ...` gives each rank its 8192 tokens.
    "ubmesh-moe-2t": dict(vocab_size=100000, hidden_size=12288, num_layers=96, num_heads=96,
                          seq_length=8192 * 16, num_experts=16, moe_top_k=1,
                          position_embeddings=False),
}
