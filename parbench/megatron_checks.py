"""The Megatron-LM arguments checked against the model parbench builds (data for
:mod:`parbench.imports`): multi-head latent attention's, DeepSeek-V3's router's,
Megatron-FSDP's, and ``--moe-layer-freq`` as ``moe_every`` / ``moe_first_dense``. Each check
writes the fields it derives into ``vals`` or raises ConfigError naming the argument."""
from __future__ import annotations

from typing import Any

from .config import ConfigError
from .megatron_args import MEGATRON_BIAS_UPDATE_RATE, MEGATRON_FSDP_STAGES, MEGATRON_MOE_DEFAULTS


def fsdp_check(args: dict[str, Any], vals: dict[str, Any]) -> None:
    """Megatron-FSDP: ``--data-parallel-sharding-strategy`` as the ZeRO stage
    (:data:`MEGATRON_FSDP_STAGES`, over the distributed optimizer's stage 1); its gradient
    dtypes must be the run's (parbench counts gradients and their messages in the model's
    element type: 2 bytes under --bf16, ``accounting=mixed_adam``)."""
    strategy = args.get("--data-parallel-sharding-strategy")
    if strategy is not None and strategy not in MEGATRON_FSDP_STAGES:
        raise ConfigError(f"Megatron argument --data-parallel-sharding-strategy={strategy} is "
                          f"not supported (parbench reads {', '.join(MEGATRON_FSDP_STAGES)})")
    if not args.get("--use-megatron-fsdp"):
        return
    vals["zero_stage"] = MEGATRON_FSDP_STAGES[strategy or "no_shard"]
    dtype = vals.get("dtype", "fp32")
    for key in ("--megatron-fsdp-grad-comm-dtype", "--megatron-fsdp-main-grads-dtype"):
        if key in args and args[key] != dtype:
            raise ConfigError(f"Megatron argument {key}={args[key]} is not supported: parbench "
                              f"counts gradients and their messages as the run's {dtype}")


def mla_check(args: dict[str, Any], vals: dict[str, Any]) -> None:
    """``--multi-latent-attention`` needs its K/V latent (``--kv-lora-rank``) and the
    latents' norms (``--qk-layernorm``, which parbench counts); the latent arguments
    without the flag are refused (Megatron ignores them then), as are query/key norms
    without MLA."""
    latent = [k for k in ("--kv-lora-rank", "--q-lora-rank", "--qk-head-dim",
                          "--qk-pos-emb-head-dim", "--v-head-dim") if k in args]
    if args.get("--multi-latent-attention"):
        if not vals.get("kv_lora_rank"):
            raise ConfigError("--multi-latent-attention needs --kv-lora-rank (the K/V "
                              "latent's width)")
        if not args.get("--qk-layernorm"):
            raise ConfigError("--multi-latent-attention without --qk-layernorm is not "
                              "supported: parbench counts MLA with its latents' RMSNorms "
                              "(DeepSeek-V2 / V3, Megatron's --qk-layernorm)")
    elif args.get("--qk-layernorm"):
        raise ConfigError("--qk-layernorm is not supported: query/key norms are not "
                          "modelled (with --multi-latent-attention they are its latents' "
                          "norms, which are)")
    elif latent:
        raise ConfigError(f"{latent[0]} without --multi-latent-attention: Megatron ignores "
                          "it; give the flag or drop the argument")


def router_checks(args: dict[str, Any], vals: dict[str, Any]) -> None:
    """The router arguments (megatron/core/transformer/moe/moe_utils.py,
    ``topk_routing_with_score_function``; the rules of transformer_config.py): the expert
    bias (sigmoid only, as Megatron-Core requires; gamma = ``--moe-router-bias-update-rate``,
    1e-3 when absent) into ``vals``; a top-k scaling factor of 0 as none (Megatron-Core
    scales by a nonzero factor only); the gates parbench computes differently refused."""
    if not vals.get("num_experts"):
        return
    if vals.get("moe_router_scaling") == 0:
        vals["moe_router_scaling"] = 1.0
    sigmoid = vals.get("moe_router") == "sigmoid"
    k = vals.get("moe_top_k", MEGATRON_MOE_DEFAULTS["moe_top_k"])
    if args.get("--moe-router-enable-expert-bias"):
        if not sigmoid:
            raise ConfigError("--moe-router-enable-expert-bias needs --moe-router-score-function "
                              "sigmoid (Megatron-Core's rule)")
        vals["moe_bias_update_rate"] = args.get("--moe-router-bias-update-rate",
                                                MEGATRON_BIAS_UPDATE_RATE)
    if sigmoid and k == 1:
        raise ConfigError("--moe-router-score-function sigmoid with --moe-router-topk 1 is not "
                          "supported: Megatron-Core gates with the sigmoid score itself, "
                          "parbench with the chosen score normalised (1)")
    if not sigmoid and k == 1 and not args.get("--moe-router-pre-softmax"):
        raise ConfigError("--moe-router-topk 1 with the softmax score needs "
                          "--moe-router-pre-softmax (Megatron-Core's rule)")
    if not sigmoid and k > 1 and args.get("--moe-router-pre-softmax"):
        raise ConfigError("--moe-router-pre-softmax with --moe-router-topk > 1 is not "
                          "supported: pre-softmax routing (top-k gates not renormalised) is "
                          "not modelled")
    _router_groups(args, vals, sigmoid, k)


def _router_groups(args: dict[str, Any], vals: dict[str, Any], sigmoid: bool, k: int) -> None:
    """Group-limited routing (moe_utils.py, ``group_limited_topk``): on with
    ``--moe-router-group-topk``, which needs ``--moe-router-num-groups``; Megatron-Core scores
    a group by the sum of its top k // group_topk scores, parbench by its top 2 (DeepSeek-V3
    Sec. 2.1.2, ``parbench.model.router``): read when they agree (DeepSeek-V3: k = 8 of 4
    groups) and with the sigmoid score (under softmax Megatron-Core groups the logits)."""
    topk_groups = vals.get("moe_router_topk_groups")
    if not topk_groups:
        return
    groups = args.get("--moe-router-num-groups")
    if not groups:
        raise ConfigError("--moe-router-group-topk needs --moe-router-num-groups "
                          "(Megatron-Core's rule)")
    if not sigmoid:
        raise ConfigError("--moe-router-group-topk with the softmax score is not supported: "
                          "Megatron-Core picks the groups by the logits, parbench by the scores")
    if k // topk_groups != 2:
        raise ConfigError(f"--moe-router-group-topk={topk_groups} with --moe-router-topk={k} "
                          "is not supported: Megatron-Core scores a group by its top "
                          f"{k // topk_groups} scores, parbench by its top 2")
    vals["moe_router_groups"] = groups


def moe_layer_freq(text: str, num_layers: int | None) -> dict[str, int]:
    """Megatron's ``--moe-layer-freq``: an integer k (every k-th layer an MoE layer), or a
    pattern of 0 (dense) and 1 (MoE) per layer such as ``([0]*3+[1]*58)`` (DeepSeek-V3's
    first three layers dense) -- as ``moe_every`` and ``moe_first_dense``; a pattern of
    another form is refused, naming it."""
    text = text.strip()
    if text.isdigit():
        return {"moe_every": int(text)}
    pattern: list[int] = []
    for term in text.strip("()").replace(" ", "").split("+"):
        head, _, times = term.partition("*")
        try:
            items = [int(x) for x in head.strip("[]").split(",")]
            pattern += items * (int(times) if times else 1)
        except ValueError:
            raise ConfigError(f"--moe-layer-freq={text} is not supported: parbench reads an "
                              "integer or a pattern like ([0]*3+[1]*58)") from None
    if num_layers is not None and len(pattern) != num_layers:
        raise ConfigError(f"--moe-layer-freq={text} gives {len(pattern)} layers, not "
                          f"--num-layers={num_layers}")
    first = pattern.index(1) if 1 in pattern else len(pattern)
    rest = pattern[first:]
    every = rest[1:].index(1) + 1 if 1 in rest[1:] else max(len(rest), 1)
    want = [0] * first + [int((i - first) % every == 0) for i in range(first, len(pattern))]
    if pattern != want or set(pattern) - {0, 1}:
        raise ConfigError(f"--moe-layer-freq={text} is not supported: parbench models dense "
                          "first layers then an MoE layer every k-th layer")
    return {"moe_every": every, "moe_first_dense": first}
