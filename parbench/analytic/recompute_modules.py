"""Which of Megatron-Core's selective-recomputation submodules (``recompute_modules``,
:data:`parbench.options.RECOMPUTE_MODULES`) parbench counts for a model and layout.

The output-discarding ones (``layernorm``, ``mla_up_proj``, ``moe_act``) and ``core_attn``
recompute local work only. ``mlp``, ``shared_experts`` and ``moe`` checkpoint a submodule
at its input, so their recomputation runs the submodule's collectives again. The MoE layer's
dispatch and combine all-to-alls repeated are counted as under full recomputation (GShard's
forward pair again: :func:`repeats_dispatch`). The tensor-parallel collectives of an MLP
(its all-reduce, or sequence parallelism's gather and reduce-scatter; expert tensor
parallelism's inside the experts) repeated alone are not in parbench's counts, so those
modules are refused where they would move such bytes: ``mlp`` and ``shared_experts`` with
tp > 1, ``moe`` with tp > 1 or expert tp > 1.
"""
from __future__ import annotations

from ..layout import ConfigError, Layout


def check_modules(shape, lay: Layout, modules: frozenset[str]) -> None:
    """Raise ConfigError for a selective module parbench cannot count on ``shape`` under
    ``lay``: ``mla_up_proj`` without multi-head latent attention (Megatron-Core refuses it
    too), a module whose recomputation repeats tensor-parallel collectives (module doc)."""
    if "mla_up_proj" in modules and not getattr(shape, "mla", False):
        raise ConfigError("recompute_modules=mla_up_proj needs multi-head latent attention "
                          "(kv_lora_rank > 0); Megatron-Core refuses it otherwise")
    repeats = {"mlp": {"tp": lay.tp}, "shared_experts": {"tp": lay.tp},
               "moe": {"tp": lay.tp, "expert tp": lay.expert_tp}}
    for name, degrees in repeats.items():
        busy = [f"{ax}={n}" for ax, n in degrees.items() if n > 1]
        if name in modules and busy:
            raise ConfigError(f"recompute_modules={name} with {', '.join(busy)}: recomputing "
                              f"the {name} submodule repeats its tensor-parallel collectives, "
                              "which parbench does not count (use it with tensor "
                              "parallelism 1, or drop it)")


def repeats_dispatch(options) -> bool:
    """Whether the MoE layer's forward dispatch and combine all-to-alls run again in
    backward: full recomputation, or selective recomputation of the ``moe`` module."""
    return options.recompute == "full" or (options.recompute == "selective"
                                           and "moe" in options.selective_modules)

def recompute_key(options) -> str:
    """The recomputation as one hashable word for the cached memory counts
    (``rank_memory``): ``none``, ``full``, ``selective``, or ``selective:<modules>`` when
    selective recomputation recomputes other modules than the attention core alone."""
    if options.recompute == "selective" and options.recompute_modules != "core_attn":
        return f"selective:{options.recompute_modules}"
    return options.recompute


def split_key(key: str) -> tuple[str, frozenset[str]]:
    """(recompute mode, selective modules) of a :func:`recompute_key` word."""
    mode, _, mods = key.partition(":")
    return mode, frozenset((mods or "core_attn").split(","))
