"""Grouped-query attention with tp above the K/V heads (issue 21), closed forms: Megatron-Core
splits the fused QKV evenly over tp whatever num_kv_heads is (no replicated weight), gathers
its output when tp > num_kv_heads, and refuses a tp that neither divides nor is a multiple of
the K/V heads. The planner prices such layouts without crashing."""
from __future__ import annotations

import pytest

from parbench.analytic import gqa
from parbench.analytic.kv_cache import kv_cache
from parbench.analytic.params import attention_params, layer_params
from parbench.analytic.shape import shape_from
from parbench.analytic.tensor import megatron_params, megatron_step_traffic
from parbench.config import PRESETS, model_preset
from parbench.plan import Space, plan
from parbench.timemodel import load_profile

#: llama-tiny: h = 32, a = 4 query heads of d = 8, g = 2 K/V heads, s = 16, 2 layers
LLAMA = shape_from(model_preset("llama-tiny"))
H, A, G, D, S, L = 32, 4, 2, 8, 16, 2


def test_the_fused_qkv_is_split_evenly_over_tp_above_the_kv_heads():
    """(a + 2g) d output rows of h columns, no bias: a 1/t of them per rank, tp = 4 > g."""
    assert attention_params(LLAMA, 4)["qkv"] == (A + 2 * G) * D * H // 4
    # the whole model's per-rank count: every rank the same, nothing counted twice
    assert megatron_params(LLAMA, 4).numel * 4 == megatron_params(LLAMA, 1).numel + \
        3 * (megatron_params(LLAMA, 1).replicated)


def test_the_qkv_output_is_gathered_and_its_gradient_reduce_scattered():
    """Per layer per micro-batch one all-gather forward (two under full recompute) and one
    reduce-scatter backward of b s (a + 2g) d fp32 values; none while tp divides g."""
    b, m = 2, 3
    msg = b * S * (A + 2 * G) * D * 4
    for sp in (False, True):
        for rc, fwd in (("none", 1), ("selective", 1), ("full", 2)):
            tr = [t for t in megatron_step_traffic(LLAMA, b, 4, m, rc, sp)
                  if t.what.startswith("GQA")]
            assert [(t.op, t.group_size, t.message_bytes, t.count) for t in tr] == [
                ("all_gather", 4, msg, fwd * L * m), ("reduce_scatter", 4, msg, L * m)]
    assert not [t for t in megatron_step_traffic(LLAMA, b, 2, m) if t.what.startswith("GQA")]


def test_kv_cache_per_rank_is_one_head_above_the_kv_heads():
    """2 (K, V) x e x b x l x d x (s + n): the rank's one K/V head, l layers."""
    b, n, e = 3, 5, 2
    out = kv_cache(LLAMA, b, n, tp=4)
    assert out.per_rank_bytes == 2 * e * b * L * D * (S + n)
    assert out.total_bytes == 2 * e * b * L * G * D * (S + n)


@pytest.mark.parametrize("heads,kv,hidden,tp,match", [
    (48, 6, 96, 4, "tp=4 and num_kv_heads=6: one must divide the other"),
    (8, 1, 8, 8, "tp=8 does not divide the fused QKV width"),  # (8 + 2) x 1 rows
])
def test_a_tp_megatron_core_refuses_is_refused(heads, kv, hidden, tp, match):
    shape = shape_from(model_preset("llama-tiny"), num_heads=heads, num_kv_heads=kv,
                       hidden_size=hidden, ffn_hidden_size=64)
    for fn in (gqa.check_query_groups, layer_params, megatron_params):
        with pytest.raises(ValueError, match=match):
            fn(shape, tp)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_the_planner_prices_every_preset_at_small_worlds(preset):
    """The bug this guards: ``plan model=llama-tiny world=16`` proposed tp=4 > num_kv_heads=2
    (the layout's rules accept it) and the pricing crashed. Every layout the rules accept must
    be priced, at the smallest worlds where tp exceeds a preset's K/V heads."""
    shape = shape_from(model_preset(preset))
    prof = load_profile("h100")
    space = Space(micro_batch_sizes=(1,), zero_stages=(0,), recomputes=("none",),
                  schedules=("1f1b",), vpps=(2,), cp_algorithms=("ring-attention",))
    for world in (8, 16):
        res = plan(shape, world, prof, world, space, keep=1, exhaustive=True)
        assert res.evaluated > 0
