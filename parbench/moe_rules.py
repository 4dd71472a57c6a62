"""The DeepSeek-style MoE fields of ``ModelConfig``: their rules (checked before anything
spawns) and the features a case uses (``Scheme.moe_features`` says which a scheme runs).

The fields (DeepSeek-V3 Technical Report, DeepSeek-AI 2024, arXiv 2412.19437, Sec. 2.1.2;
DeepSeekMoE, Dai et al. 2024, Sec. 3.1-3.2; Megatron-Core's names in brackets):

- ``moe_ffn_hidden_size``: each routed expert's hidden size, fine-grained experts
  (--moe-ffn-hidden-size; 0 = ffn_hidden_size);
- ``moe_shared_expert_size``: one always-on MLP of that hidden size on every MoE layer, its
  output added to the routed one (--moe-shared-expert-intermediate-size; 0 = none);
- ``moe_first_dense``: the first layers keep a dense MLP (DeepSeek's first_k_dense_replace);
- ``moe_router``: ``softmax`` (Switch / GShard) or ``sigmoid`` (DeepSeek-V3 Eq. 15-16:
  affinities s = sigmoid(u . e), gates = the selected s normalised to sum 1)
  (--moe-router-score-function);
- ``moe_bias_update_rate``: gamma of the auxiliary-loss-free balancing bias (Sec. 2.1.2; 0 =
  no bias) (--moe-router-enable-expert-bias, --moe-router-bias-update-rate);
- ``moe_router_groups`` / ``moe_router_topk_groups``: group-limited routing (Sec. 2.1.2,
  "Node-Limited Routing") (--moe-router-num-groups, --moe-router-group-topk);
- ``moe_router_scaling``: the routed gates, once normalised, times this factor (DeepSeek-V3's
  ``routed_scaling_factor`` 2.5; 1 = none) (--moe-router-topk-scaling-factor).
"""
from __future__ import annotations

from .layout import ConfigError

#: the DeepSeek-style MoE fields of ``ModelConfig`` (read by the schemes that run them)
DEEPSEEK_MOE_FIELDS = ("moe_ffn_hidden_size", "moe_shared_expert_size", "moe_first_dense",
                       "moe_router", "moe_bias_update_rate", "moe_router_groups",
                       "moe_router_topk_groups", "moe_router_scaling")

#: the scores a router may compute
ROUTERS = ("softmax", "sigmoid")

#: the DeepSeek-style MoE features (``moe_features``) a scheme may declare it runs
MOE_FEATURES = frozenset({"fine-grained", "shared-expert", "first-dense", "sigmoid-router",
                          "expert-bias", "group-limited", "router-scaling", "llama-experts"})


def moe_features(m) -> dict[str, str]:
    """The DeepSeek-style MoE features model ``m`` uses, each with the field that turns it
    on (none for a dense model: the fields then do nothing and ``validate_moe`` refuses
    them)."""
    on = {"fine-grained": (m.moe_ffn_hidden_size, "moe_ffn_hidden_size"),
          "shared-expert": (m.moe_shared_expert_size, "moe_shared_expert_size"),
          "first-dense": (m.moe_first_dense, "moe_first_dense"),
          "sigmoid-router": (m.moe_router != "softmax", "moe_router"),
          "expert-bias": (m.moe_bias_update_rate, "moe_bias_update_rate"),
          "group-limited": (m.moe_router_groups, "moe_router_groups"),
          "router-scaling": (m.moe_router_scaling != 1.0, "moe_router_scaling"),
          # Mixtral's experts (Jiang et al. 2024): SwiGLU MLPs, no biases, as the dense MLP
          "llama-experts": (m.num_experts and (m.mlp != "gelu" or not m.bias),
                            "mlp" if m.mlp != "gelu" else "bias")}
    return {name: f"{field}={getattr(m, field)}" for name, (used, field) in on.items()
            if used}


def validate_moe(m) -> None:
    """The MoE fields' cross-field rules (each field's own rule is checked with the others:
    ``config.validate_fields``)."""
    if m.moe_router not in ROUTERS:
        raise ConfigError(f"moe_router={m.moe_router!r} must be one of {', '.join(ROUTERS)}")
    used = moe_features(m)
    if used and not m.num_experts:
        raise ConfigError(f"{next(iter(used.values()))} needs an MoE model (num_experts > 0)")
    if m.num_experts and m.moe_first_dense >= m.num_layers:
        raise ConfigError(f"moe_first_dense={m.moe_first_dense} leaves no MoE layer: it must "
                          f"be < num_layers={m.num_layers}")
    validate_router_groups(m)


def validate_router_groups(m) -> None:
    """Group-limited routing (DeepSeek-V3 Sec. 2.1.2): G groups of E/G experts, at least 2
    each (a group's score is the sum of its top-2 affinities), topk_groups of them kept per
    token, enough experts in them for the top-k."""
    g, tg, e, k = m.moe_router_groups, m.moe_router_topk_groups, m.num_experts, m.moe_top_k
    if not g:
        if tg:
            raise ConfigError(f"moe_router_topk_groups={tg} needs moe_router_groups > 0")
        return
    if e % g:
        raise ConfigError(f"moe_router_groups={g} does not divide num_experts={e}")
    if e // g < 2:
        raise ConfigError(f"moe_router_groups={g}: each group needs at least 2 of the "
                          f"num_experts={e} experts (a group's score is the sum of its top-2 "
                          "affinities, DeepSeek-V3 Sec. 2.1.2)")
    if not 1 <= tg <= g:
        raise ConfigError(f"moe_router_topk_groups={tg} must be in [1, moe_router_groups={g}]")
    if k > tg * (e // g):
        raise ConfigError(f"moe_top_k={k} exceeds the {tg * (e // g)} experts of "
                          f"moe_router_topk_groups={tg} groups of {e // g}")
