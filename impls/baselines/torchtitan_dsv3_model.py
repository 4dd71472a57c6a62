"""torchtitan's own DeepSeek-V3 model (``torchtitan.models.deepseek_v3.DeepSeekV3Model``,
torchtitan 0.3.0) built for a parbench case, and the reference model's weights mapped into
it (and its parameters or gradients back).

The config is assembled as torchtitan's ``deepseekv3_configs`` assemble theirs
(``_build_dsv3_layers``: MLA attention, a dense SwiGLU ``FeedForward`` on the first
``n_dense_layers`` layers, then ``MoE``: ``TokenChoiceTopKRouter``, ``GroupedExperts``
(``w1_EFD``, ``w2_EDF``, ``w3_EFD``: SwiGLU, no biases) and a shared ``FeedForward``), with the
case's sizes and routing (DeepSeek-V3 Technical Report, arXiv 2412.19437, Sec. 2.1.2):

- ``score_func`` = ``moe_router``, ``num_expert_groups`` / ``num_limited_groups`` =
  ``moe_router_groups`` / ``moe_router_topk_groups`` (a group's score: its top-2 sum, as
  parbench's), ``route_norm`` where parbench normalises the gates (sigmoid, or k > 1),
  ``route_scale`` = ``moe_router_scaling``;
- ``load_balance_coeff`` = ``moe_bias_update_rate`` (None: no bias); torchtitan's configs
  leave it at ``make_moe_config``'s 1e-3;
- RoPE without YaRN (``scaling="none"``: parbench's RoPE has no frequency scaling, so the
  softmax scale is 1 / sqrt(d + d_R), DeepSeek-V2 Eq. 17), no multi-token prediction;
- the inner attention is ``ScaledDotProductAttention`` (FlexAttention has no CPU backward),
  as ``impls.baselines.torchtitan_model`` does for Llama 3.

RoPE conventions differ as for Llama 3 (``torchtitan_model``): torchtitan rotates
interleaved pairs, parbench the halves; each head's rotary query rows (of ``q_up`` /
``q_proj``) and the shared rotary key rows of ``kv_down`` are permuted by ``rope_rows``.
The mapping is data: ``ATTENTION``, ``DENSE``, ``MOE`` (parbench suffix -> torchtitan
suffix), the rows permuted (``ROPE``) and the fused tensors split (``SPLIT``, ``EXPERTS``).
"""
from __future__ import annotations

import contextlib

import torch

from parbench.model.blocks import NORM_EPS
from parbench.model.mla import LATENT_EPS, MLADims
from parbench.model.moe import is_moe_layer

from impls.baselines.torchtitan_model import rope_rows

#: per layer, parbench suffix -> torchtitan suffix (the same tensor)
ATTENTION = {"ln1.weight": "attention_norm.weight", "ln2.weight": "ffn_norm.weight",
             "attn.q_down.weight": "attention.wq_a.weight",
             "attn.q_norm.weight": "attention.q_norm.weight",
             "attn.q_up.weight": "attention.wq_b.weight",
             "attn.q_proj.weight": "attention.wq.weight",
             "attn.kv_down.weight": "attention.wkv_a.weight",
             "attn.kv_norm.weight": "attention.kv_norm.weight",
             "attn.kv_up.weight": "attention.wkv_b.weight",
             "attn.proj.weight": "attention.wo.weight"}
DENSE = {"mlp.fc2.weight": "feed_forward.w2.weight"}
MOE = {"mlp.router.weight": "moe.router.gate.weight",
       "mlp.shared_expert.fc2.weight": "moe.shared_experts.w2.weight"}
#: SwiGLU's fused fc1 [gate; up] -> torchtitan's w1 (gate) and w3 (up)
SPLIT = {"mlp.fc1.weight": ("feed_forward.w1.weight", "feed_forward.w3.weight"),
         "mlp.shared_expert.fc1.weight": ("moe.shared_experts.w1.weight",
                                          "moe.shared_experts.w3.weight")}
#: the routed experts, stacked: (parbench's per-expert suffix, torchtitan's stacked tensor,
#: which half of fc1: 0 gate, 1 up, None: fc2)
EXPERTS = (("fc1.weight", "moe.routed_experts.inner_experts.w1_EFD", 0),
           ("fc1.weight", "moe.routed_experts.inner_experts.w3_EFD", 1),
           ("fc2.weight", "moe.routed_experts.inner_experts.w2_EDF", None))
#: the rows of a tensor torchtitan's RoPE reads interleaved: "q" per head, "kv" the key
ROPE = {"attn.q_up.weight": "q", "attn.q_proj.weight": "q", "attn.kv_down.weight": "kv"}
#: the balancing bias (a model state, not a parameter)
BIAS = ("mlp.router.expert_bias", "moe.expert_bias_E")


def rope_order(kind: str, d: MLADims) -> torch.Tensor:
    """``idx`` with ``titan_rows = reference_rows[idx]``: per head [q_C; q_R] with q_R's rows
    interleaved (``kind`` "q"), or [c_KV; k_R] with k_R's rows interleaved ("kv")."""
    def one(offset: int, plain: int) -> torch.Tensor:
        return torch.cat([torch.arange(plain) + offset, rope_rows(1, d.rope) + offset + plain])
    if kind == "kv":
        return one(0, d.kv_rank)
    return torch.cat([one(i * (d.qk + d.rope), d.qk) for i in range(d.heads)])


def _layer_names(cfg, i: int) -> dict[str, str]:
    """Layer ``i``'s one-to-one names, parbench's -> torchtitan's (full names)."""
    table = {**ATTENTION, **(MOE if is_moe_layer(cfg, i) else DENSE)}
    if not cfg.moe_shared_expert_size:
        table.pop("mlp.shared_expert.fc2.weight", None)
    skip = ("attn.q_proj.weight" if cfg.q_lora_rank else
            ("attn.q_down.weight", "attn.q_norm.weight", "attn.q_up.weight"))
    return {f"blocks.{i}.{o}": f"layers.{i}.{t}" for o, t in table.items() if o not in skip}


def _splits(cfg, i: int) -> dict[str, tuple[str, str]]:
    """Layer ``i``'s fused fc1 (the dense MLP's, or the shared expert's) -> w1, w3."""
    if not is_moe_layer(cfg, i):
        key = "mlp.fc1.weight"
    elif cfg.moe_shared_expert_size:
        key = "mlp.shared_expert.fc1.weight"
    else:
        return {}
    return {f"blocks.{i}.{key}": tuple(f"layers.{i}.{t}" for t in SPLIT[key])}


def name_map(cfg) -> dict[str, str]:
    """Every one-to-one tensor, parbench name -> torchtitan name."""
    out = {"embed.tok.weight": "tok_embeddings.weight", "head.ln.weight": "norm.weight",
           "head.out.weight": "lm_head.weight"}
    for i in range(cfg.num_layers):
        out.update(_layer_names(cfg, i))
    return out


def _rope_kind(name: str) -> str | None:
    return ROPE.get(name.split(".", 2)[-1])


def to_titan(cfg, ref: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The reference model's parameters ``ref`` (parbench names) as torchtitan's."""
    d = MLADims.of(cfg)
    out = {}
    for ours, theirs in name_map(cfg).items():
        kind = _rope_kind(ours)
        out[theirs] = ref[ours] if kind is None else ref[ours][rope_order(kind, d)]
    for i in range(cfg.num_layers):
        for ours, (w1, w3) in _splits(cfg, i).items():
            out[w1], out[w3] = ref[ours].chunk(2)
        if is_moe_layer(cfg, i):
            out.update(_stack_experts(cfg, i, ref))
    return out


def _stack_experts(cfg, i: int, ref: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for ours, theirs, half in EXPERTS:
        per = [ref[f"blocks.{i}.mlp.experts.{e}.{ours}"] for e in range(cfg.num_experts)]
        out[f"layers.{i}.{theirs}"] = torch.stack(
            per if half is None else [t.chunk(2)[half] for t in per])
    return out


def from_titan(cfg, titan: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """torchtitan's parameters (or gradients) ``titan`` under parbench's names and layout
    (the inverse of ``to_titan``)."""
    d = MLADims.of(cfg)
    out = {}
    for ours, theirs in name_map(cfg).items():
        kind = _rope_kind(ours)
        if kind is None:
            out[ours] = titan[theirs]
        else:
            out[ours] = torch.empty_like(titan[theirs])
            out[ours][rope_order(kind, d)] = titan[theirs]
    for i in range(cfg.num_layers):
        for ours, (w1, w3) in _splits(cfg, i).items():
            out[ours] = torch.cat([titan[w1], titan[w3]])
        if is_moe_layer(cfg, i):
            out.update(_unstack_experts(cfg, i, titan))
    return out


def _unstack_experts(cfg, i: int, titan: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    w1, w3, w2 = (titan[f"layers.{i}.{theirs}"] for _, theirs, _ in EXPERTS)
    out = {}
    for e in range(cfg.num_experts):
        pre = f"blocks.{i}.mlp.experts.{e}"
        out[f"{pre}.fc1.weight"] = torch.cat([w1[e], w3[e]])
        out[f"{pre}.fc2.weight"] = w2[e]
    return out


def bias_names(cfg) -> dict[str, str]:
    """The balancing biases, parbench name -> torchtitan name (none without the bias)."""
    if not cfg.moe_bias_update_rate:
        return {}
    ours, theirs = BIAS
    return {f"blocks.{i}.{ours}": f"layers.{i}.{theirs}" for i in range(cfg.num_layers)
            if is_moe_layer(cfg, i)}


def _titan_layers(cfg):
    """torchtitan's per-layer configs (``_build_dsv3_layers``) for ``cfg``."""
    from torchtitan.models.common import ComplexRoPE
    from torchtitan.models.deepseek_v3 import _build_dsv3_layers
    d, moe = MLADims.of(cfg), cfg.num_experts > 0
    expert = cfg.moe_ffn_hidden_size or cfg.ffn
    shared = cfg.moe_shared_expert_size // expert if moe else 0
    groups = cfg.moe_router_groups or None
    return _build_dsv3_layers(
        n_layers=cfg.num_layers, n_dense_layers=cfg.moe_first_dense if moe else cfg.num_layers,
        dim=cfg.hidden_size, n_heads=d.heads, q_lora_rank=d.q_rank, kv_lora_rank=d.kv_rank,
        qk_nope_head_dim=d.qk, qk_rope_head_dim=d.rope, v_head_dim=d.v, mscale=1.0,
        dense_hidden_dim=cfg.ffn, moe_hidden_dim=expert,
        num_experts=max(cfg.num_experts, 1), num_shared_experts=max(shared, 1),
        router_top_k=cfg.moe_top_k, router_score_func=cfg.moe_router,
        router_num_expert_groups=groups,
        router_num_limited_groups=cfg.moe_router_topk_groups if groups else None,
        router_route_scale=cfg.moe_router_scaling,
        router_route_norm=cfg.moe_router == "sigmoid" or cfg.moe_top_k > 1,
        attn_backend="flex", moe_comm_backend="standard", non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(dim=d.rope, max_seq_len=cfg.seq_length,
                                theta=cfg.rope_theta, scaling="none"))


def _adapt_layer(layer, cfg) -> None:
    """The CPU attention, parbench's epsilons, the bias rate and the shared expert."""
    from torchtitan.models.common.attention import ScaledDotProductAttention
    att = layer.attention
    att.inner_attention = ScaledDotProductAttention.Config()
    layer.attention_norm.eps = layer.ffn_norm.eps = NORM_EPS
    att.q_norm.eps = att.kv_norm.eps = LATENT_EPS
    if layer.moe is not None:
        layer.moe.load_balance_coeff = cfg.moe_bias_update_rate or None
        if not cfg.moe_shared_expert_size:
            layer.moe.shared_experts = None


def titan_config(cfg):
    """torchtitan's ``DeepSeekV3Model.Config`` for parbench model config ``cfg``."""
    from torchtitan.models.common import Embedding, Linear, RMSNorm
    from torchtitan.models.deepseek_v3 import DeepSeekV3Model
    layers = _titan_layers(cfg)
    for layer in layers:
        _adapt_layer(layer, cfg)
    h, v = cfg.hidden_size, cfg.vocab_size
    return DeepSeekV3Model.Config(
        dim=h, vocab_size=v,
        tok_embeddings=Embedding.Config(num_embeddings=v, embedding_dim=h),
        norm=RMSNorm.Config(normalized_shape=h, eps=NORM_EPS),
        lm_head=Linear.Config(in_features=h, out_features=v), layers=layers, mtp_layers=[])


def _fp32_grouped_experts(self, x_RD, num_tokens_per_expert_E):
    """``GroupedExperts.forward``'s arithmetic (SwiGLU over the expert-sorted tokens, the
    same ``torch._grouped_mm`` with the same offsets, the DTensor weights' local shards)
    without its casts to bf16."""
    import torch.nn.functional as F
    offs = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
    w1, w2, w3 = (w.to_local() if hasattr(w, "to_local") else w
                  for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD))

    def mm(a, w):
        return torch._grouped_mm(a, w.transpose(-2, -1), offs=offs)
    return mm(F.silu(mm(x_RD, w1)) * mm(x_RD, w3), w2)


@contextlib.contextmanager
def fp32_experts():
    """torchtitan's routed experts computed in fp32 while the context is open: isolates the
    weight mapping from its bf16 finding (the mapping test and
    ``scripts/torchtitan_dsv3_findings.py``; the scheme runs torchtitan's own bf16)."""
    from torchtitan.models.common.moe import GroupedExperts
    own = GroupedExperts.forward
    GroupedExperts.forward = _fp32_grouped_experts
    try:
        yield
    finally:
        GroupedExperts.forward = own


def titan_model(cfg, ref: torch.nn.Module) -> torch.nn.Module:
    """torchtitan's DeepSeek-V3 for ``cfg`` (one process, unparallelized) holding the
    reference model ``ref``'s weights."""
    model = titan_config(cfg).build()
    weights = to_titan(cfg, {n: p.detach() for n, p in ref.named_parameters()})
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(weights[n])
    return model
