"""The forward seconds selective recomputation repeats in one layer, module by module
(Megatron-Core's ``recompute_modules``, :data:`parbench.options.RECOMPUTE_MODULES`), priced
with the same operator count as the layer's forward (``costs``):

- ``core_attn``: the attention core's forward (Korthikanti et al. 2022, Sec. 5);
- ``layernorm``: the two norms, each reading its input and writing its output;
- ``mla_up_proj``: MLA's up projections from the query and K/V latents (DeepSeek-V2,
  Eqs. 12-13, 16); the RoPE pass over their rotary parts is left unpriced (elementwise, on
  d_R of every head's width);
- ``mlp``: a dense layer's fc1 and fc2 GEMMs and its activation;
- ``moe_act``: the experts' activation over their routed rows;
- ``shared_experts``: the shared experts' GEMMs and activation;
- ``moe``: the router and the experts' GEMMs and activation (its all-to-alls, which would
  repeat, are refused by ``analytic.recompute_modules.check_modules`` where ep > 1).

A module the layer does not hold (``mlp`` in an MoE layer, the MoE modules in a dense one,
``mla_up_proj`` without MLA) costs nothing, as Megatron-Core applies it nowhere there.
"""
from __future__ import annotations

from .costs import _gemms, moe_local


def _mlp_forward(profile, rows: int, f_out: int, h: int, gated: bool, e: int, dt: str
                 ) -> float:
    """One MLP's forward on ``rows`` tokens: fc1 (2f wide when gated), fc2, and the
    activation's memory pass (GeLU reads f, writes f; SwiGLU reads 2f, writes f)."""
    fc1 = _gemms(profile, rows, f_out * (2 if gated else 1), h, dt)[0]
    fc2 = _gemms(profile, rows, h, f_out, dt)[0]
    return fc1 + fc2 + _act(profile, rows, f_out, gated, e)


def _act(profile, rows: int, f_out: int, gated: bool, e: int) -> float:
    return profile.mem_time((3 if gated else 2) * rows * f_out * e, 1)


def _mla_up(shape, profile, loc) -> float:
    """MLA's up projections on the rank's a/t heads (``costs.mla_gemms``' shapes)."""
    if not getattr(shape, "mla", False):
        return 0.0
    d_nope = shape.qk_head_dim or shape.head_dim
    d_qk, d_v = d_nope + shape.qk_rope_head_dim, shape.v_head_dim or shape.head_dim
    q = _gemms(profile, loc.T, loc.a_l * d_qk, shape.q_lora_rank, loc.dt)[0] \
        if shape.q_lora_rank else 0.0
    return q + _gemms(profile, loc.T, loc.a_l * (d_nope + d_v), shape.kv_lora_rank, loc.dt)[0]


def _moe_parts(shape, trn, profile, loc) -> dict[str, float]:
    """The MoE modules' forward seconds: the routed experts' activation, the shared
    experts, and the whole layer (router, experts, shared experts)."""
    mo = moe_local(shape, trn.layout.ep, trn.layout.etp or loc.tp, loc.tp, loc.T_ln)
    local_rows = mo.per_expert * mo.n_local
    shared = _mlp_forward(profile, loc.T, mo.shared, loc.h, loc.gated, loc.e, loc.dt) \
        if mo.shared else 0.0
    experts = _mlp_forward(profile, local_rows, mo.fe, loc.h, loc.gated, loc.e, loc.dt)
    router = _gemms(profile, loc.T_ln, shape.num_experts, loc.h, loc.dt)[0]
    return {"moe_act": _act(profile, local_rows, mo.fe, loc.gated, loc.e),
            "shared_experts": shared, "moe": router + experts + shared}


def selective_forward_s(shape, trn, profile, loc, moe_layer: bool, attention_f: float
                        ) -> float:
    """The forward seconds ``recompute=selective`` repeats in one layer for the modules of
    ``trn.options.selective_modules`` (module doc); ``attention_f``: the attention core's
    forward, ``loc``: the layer's local shape (``transformer_layer._LocalLayer``)."""
    mods = trn.options.selective_modules
    norm_bytes = 2 * (2 * loc.T_ln * loc.h * loc.e)  # two norms, each read and written
    parts = {"core_attn": attention_f, "layernorm": profile.mem_time(norm_bytes, 2),
             "mla_up_proj": _mla_up(shape, profile, loc)}
    if moe_layer:
        parts.update(_moe_parts(shape, trn, profile, loc))
    else:
        parts["mlp"] = _mlp_forward(profile, loc.T, shape.f // loc.tp, loc.h, loc.gated,
                                    loc.e, loc.dt)
    return sum(parts.get(m, 0.0) for m in mods)
