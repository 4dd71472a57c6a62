"""Multi-head latent attention in the reference model (``parbench.model.mla``): its
parameters are those the analytic model counts, and the config rules that let it run."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from parbench.analytic import shape_from
from parbench.analytic.params import dense_block_tensor_sizes, total_params
from parbench.config import ConfigError, model_preset, validate_model, validate_runnable_model
from parbench.model import build_model

SHAPES = [dict(),  # mla-tiny: query latent, rotary parts
          dict(q_lora_rank=0),  # queries straight from x (DeepSeek-V2-Lite)
          dict(qk_head_dim=0, v_head_dim=0, kv_lora_rank=6, qk_rope_head_dim=2),  # head_dim
          dict(num_heads=8, q_lora_rank=20, v_head_dim=5, num_layers=1)]


@pytest.mark.parametrize("change", SHAPES)
def test_native_parameters_equal_the_analytic_count(change):
    cfg = replace(model_preset("mla-tiny"), **change)
    model = build_model(cfg, seed=0)
    shape = shape_from(cfg)
    assert sum(p.numel() for p in model.parameters()) == total_params(shape)
    block = [p.numel() for p in model.blocks["0"].parameters()]
    assert block == dense_block_tensor_sizes(shape)  # tensor by tensor, in order


def test_latent_norms_start_at_one_and_the_loss_is_finite():
    cfg = model_preset("mla-tiny")
    model = build_model(cfg, seed=0)
    attn = model.blocks["0"].attn
    assert torch.equal(attn.kv_norm.weight, torch.ones(cfg.kv_lora_rank))
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length))
    assert torch.isfinite(model(x, x))


@pytest.mark.parametrize("change, words", [
    (dict(bias=True), "bias=true"),
    (dict(qk_rope_head_dim=3), "even"),
    (dict(qk_rope_head_dim=0), "qk_rope_head_dim > 0"),
    (dict(kv_lora_rank=0), "needs kv_lora_rank > 0"),
])
def test_mla_rules_name_field_and_rule(change, words):
    cfg = replace(model_preset("mla-tiny"), **change)
    with pytest.raises(ConfigError, match=words):
        validate_model(cfg)
        validate_runnable_model(cfg)
