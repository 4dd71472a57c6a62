"""Grouped-query attention with more tensor-parallel ranks than K/V heads, as Megatron-Core
runs it (attention.py: with num_query_groups < tp each rank's QKV projection is its whole
query group, replicated tp / num_query_groups times): the analytic model counts it, refuses a
tp that neither divides nor is a multiple of num_kv_heads, and the planner prices every
preset's layouts at small worlds without an error (``plan model=llama-tiny world=16`` raised
"tp=4 does not divide num_kv_heads=2" on a layout the layout rules accept)."""
from __future__ import annotations

import dataclasses

import pytest

from parbench.analytic.kv_cache import kv_cache
from parbench.analytic.params import attention_params, layer_breakdown
from parbench.analytic.shape import shape_from
from parbench.config import PRESETS, model_preset
from parbench.plan import plan
from parbench.timemodel import load_profile


def test_a_replicated_group_is_counted_whole_on_each_rank():
    shape = shape_from(model_preset("llama-tiny"))
    h, a, g = shape.h, shape.a, shape.kv_heads
    assert not shape.bias and g < a
    d = h // a
    tp = 2 * g  # two ranks per query group
    # the group's a / g query heads and one K and one V head, each d wide, from h inputs
    assert attention_params(shape, tp)["qkv"] == h * (a // g + 2) * d
    # split as before when tp divides the groups: (h + 2 g d) h / tp
    assert attention_params(shape, g)["qkv"] == h * (h + 2 * g * d) // g
    # the output projection is split by tp either way
    assert attention_params(shape, tp)["proj"] == h * h // tp


def test_the_kv_cache_of_a_replicated_head_is_one_head_per_rank():
    shape = shape_from(model_preset("llama-tiny"))
    d = shape.h // shape.a
    one, two = (kv_cache(shape, 1, 0, tp=tp).per_rank_bytes for tp in (shape.kv_heads,
                                                                         2 * shape.kv_heads))
    assert one == two == 2 * 2 * shape.l * d * shape.s  # K and V, bf16, one head


def test_neither_divisor_nor_multiple_is_refused():
    shape = dataclasses.replace(shape_from(model_preset("llama-tiny")), num_heads=12,
                                num_kv_heads=4, hidden_size=96)
    with pytest.raises(ValueError, match="tp=6 and num_kv_heads=4: one must divide the other"):
        layer_breakdown(shape, 6)


@pytest.mark.parametrize("world", [4, 16])
def test_the_planner_prices_every_preset_at_small_worlds(world):
    profile = load_profile("h100")
    for name in sorted(PRESETS):
        res = plan(shape_from(model_preset(name)), world, profile, world)
        assert res.evaluated >= 0  # priced without an error
