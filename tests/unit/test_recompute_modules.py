"""Selective recomputation by module (Megatron-Core's ``recompute_modules``): the option's
rules, what each module leaves out of the activation count (from Megatron-Core's
definitions: the norms' outputs, MLA's up-projected Q/K/V, a dense MLP's fc1 and activation
outputs, the experts' activation output, the shared experts', the whole MoE layer's), the
time model's repeated forward, and the refusals (``analytic.recompute_modules``)."""
from __future__ import annotations

import pytest

from parbench.analytic import activations
from parbench.analytic.recompute_modules import check_modules
from parbench.analytic.shape import shape_from
from parbench.config import CaseConfig, ConfigError
from parbench.layout import Layout
from parbench.options import Options
from parbench.overrides import apply_overrides
from parbench.timemodel import Training, load_profile, predict_step


def test_modules_are_megatrons_names_in_its_order():
    o = Options(recompute="selective", recompute_modules="mlp, layernorm")
    assert o.recompute_modules == "layernorm,mlp"
    assert o.selective_modules == {"layernorm", "mlp"}
    assert Options().recompute_modules == "core_attn"
    with pytest.raises(ConfigError, match="recompute_modules='attn' must name one or more"):
        Options(recompute_modules="attn")


S, B, H, A, T, F = 64, 2, 32, 4, 2, 96


def _dense(mods, **kw):
    return activations.layer_activation_bytes(S, B, H, A, T, False, "selective", F,
                                              attention="flash", modules=frozenset(mods), **kw)


def test_each_dense_module_drops_what_megatron_core_recomputes():
    """Bytes per tp rank, e = 2: layernorm drops the QKV and fc1 inputs (2 s b h, whole on
    every rank without SP); mlp the fc1 and GeLU outputs (2 s b f / t); without core_attn the
    fused kernel's output and log-sum-exp stay (s b h / t + a s b 4 / t)."""
    core = _dense({"core_attn"})
    assert core - _dense({"core_attn", "layernorm"}) == 2 * S * B * H * 2
    assert core - _dense({"core_attn", "mlp"}) == 2 * S * B * F * 2 / T
    assert _dense({"layernorm"}) - _dense({"core_attn", "layernorm"}) == \
        (S * B * H * 2 + A * S * B * 4) / T
    widths = (48, 48, 32, 32)
    mla = dict(widths=widths, latent=40)
    assert _dense({"core_attn"}, **mla) - _dense({"core_attn", "mla_up_proj"}, **mla) == \
        (48 + 48 + 32) * S * B * 2 / T


def test_each_moe_module_drops_its_routed_terms():
    """moe_act keeps the experts' fc1 output but not the activation's (SwiGLU: 2 of 3
    widths); shared_experts drops the shared MLP; moe every routed term."""
    kw = dict(s=S, b=B, h=H, f=F, tp=1, tokens=S * B, rows=2 * S * B, num_experts=8,
              mlp="swiglu", expert_f=24, shared_f=24, recompute="selective")
    base = activations.moe_layer_activation_bytes(1000.0, **kw)
    act = activations.moe_layer_activation_bytes(1000.0, **kw, modules=frozenset(
        {"core_attn", "moe_act"}))
    assert act["expert_mlp"] == base["expert_mlp"] * 2 / 3 == 2 * (2 * S * B) * 24 * 2
    shared = activations.moe_layer_activation_bytes(1000.0, **kw, modules=frozenset(
        {"shared_experts"}))
    assert shared["shared_mlp"] == 0 and shared["expert_mlp"] == base["expert_mlp"]
    whole = activations.moe_layer_activation_bytes(1000.0, **kw, modules=frozenset({"moe"}))
    assert whole["total"] == 1000.0 + base["dense_mlp_replaced"]


def test_modules_parbench_cannot_count_are_refused_by_name():
    llama = shape_from(apply_overrides(CaseConfig(), {"model": "llama-tiny"}).model)
    with pytest.raises(ConfigError, match="mla_up_proj needs multi-head latent attention"):
        check_modules(llama, Layout(), frozenset({"mla_up_proj"}))
    with pytest.raises(ConfigError, match="recompute_modules=mlp with tp=2"):
        check_modules(llama, Layout(tp=2), frozenset({"mlp"}))
    check_modules(llama, Layout(dp=2), frozenset({"mlp", "layernorm", "core_attn"}))


def test_run_recomputes_the_attention_core_only():
    from parbench.registry import get_scheme
    case = apply_overrides(CaseConfig(), {"scheme": "data.ddp", "dp": 2,
                                          "recompute": "selective",
                                          "recompute_modules": "layernorm"})
    with pytest.raises(ConfigError, match="recompute_modules=layernorm: run recomputes the "
                                          "attention core only"):
        get_scheme("data.ddp").check(case)


def test_recomputed_forward_adds_up_over_modules():
    """The time model repeats each module's forward: the step's recompute seconds of a set
    of modules is the sum over its members (disjoint parts of the layer), and core_attn
    alone is the selective recomputation priced before modules existed (the attention core)."""
    shape = shape_from(apply_overrides(CaseConfig(), {"model": "llama3-8b"}).model)
    prof = load_profile("h100")

    def rc(mods):
        trn = Training.of(dp=8, micro_batch_size=1, num_microbatches=4, recompute="selective",
                          sp=False, zero_stage=1, attention="flash")
        trn = trn.with_values(recompute_modules=mods)
        return predict_step(shape, trn, prof).recompute_s
    parts = {m: rc(m) for m in ("core_attn", "layernorm", "mlp")}
    assert all(v > 0 for v in parts.values())
    assert rc("core_attn,layernorm,mlp") == pytest.approx(sum(parts.values()), rel=1e-9)
    assert parts["mlp"] > parts["layernorm"]  # GEMMs against one memory pass
