"""LLaMA-style blocks in the reference model (issue 21, sec. 1): RoPE, grouped-query attention,
SwiGLU, RMSNorm, no biases. The golden run executes them; the data family and the pipeline
schedules train them against it; schemes that do not declare a feature
(``Scheme.model_features``) refuse it before spawning, naming the field."""
from __future__ import annotations

import pytest
import torch

from parbench.analytic.params import total_params
from parbench.analytic.shape import shape_from
from parbench.config import CaseConfig, ConfigError, model_preset, validate_case
from parbench.golden.run import reference_model
from parbench.model.blocks import rotate
from parbench.overrides import apply_overrides
from parbench.registry import get_scheme
from tests.helpers import assert_layer_activations, assert_wire_and_calls_per_step, run_on_pool

BASE = {"model": "llama-tiny", "dp": "2", "num_microbatches": "2", "steps": "3",
        "timed_steps": "1", "bucket_mb": "0.002"}
PIPE = {"model": "llama-tiny", "num_layers": "4", "dp": "1", "pp": "2",
        "num_microbatches": "4", "micro_batch_size": "1", "steps": "3", "timed_steps": "1"}


def case_for(scheme: str, base=None, **extra) -> CaseConfig:
    case = apply_overrides(CaseConfig(), {**(base or BASE), "scheme": scheme, **extra})
    validate_case(case)
    get_scheme(scheme).check(case)
    return case


@pytest.mark.parametrize("preset,published", [
    ("llama3-8b", 8_030_261_248), ("llama3-70b", 70_553_706_496),
    ("llama3-405b", 405_853_388_800)])
def test_llama3_presets_have_the_published_parameter_counts(preset, published):
    """Meta's model cards and config.json (Dubey et al. 2024, Table 3)."""
    assert total_params(shape_from(model_preset(preset))) == published


def test_the_reference_model_has_the_analytic_parameter_count():
    case = case_for("data.ddp")
    model = reference_model(case)
    assert sum(p.numel() for p in model.parameters()) == total_params(shape_from(case.model))
    assert not any(n.endswith(".bias") for n, _ in model.named_parameters())


def test_rope_scores_depend_on_the_relative_position_only():
    """Su et al. 2021, Eq. 16: <R(m) q, R(n) k> is a function of m - n."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, 1, 8, generator=g), torch.randn(1, 1, 1, 8, generator=g)

    def score(m, n):
        return float((rotate(q, torch.tensor([m]), 1e4) * rotate(k, torch.tensor([n]), 1e4)).sum())
    assert abs(score(5, 2) - score(13, 10)) < 1e-5
    assert abs(score(5, 2) - score(5, 3)) > 1e-3


def test_grouped_query_heads_share_their_kv_head():
    """With 4 query heads on 2 K/V heads, query heads 0 and 1 read K/V head 0."""
    case = case_for("data.ddp")
    attn = reference_model(case).blocks["0"].attn
    x = torch.randn(1, 5, case.model.hidden_size)
    q, k, v = attn.heads(attn.qkv(x))
    assert torch.equal(k[:, 0], k[:, 1]) and torch.equal(v[:, 2], v[:, 3])
    assert not torch.equal(k[:, 1], k[:, 2])


@pytest.mark.parametrize("scheme,extra", [
    ("zero.1", {}), ("zero.3", {}), ("baseline.torch.fsdp2", {}),
    ("data.ddp", {"pack_docs": "3"})])
def test_the_data_family_trains_llama_blocks(pools, scheme, extra):
    """Equal to the golden run, and every step's bytes and calls equal the closed form's
    (``analytic.params.dense_block_tensor_sizes``: the LLaMA tensors) for the native
    schemes (the FSDP2 baseline has no closed form)."""
    case = case_for(scheme, **extra)
    merged, per_rank = run_on_pool(pools, case)
    assert merged.equivalent, merged.first_failure
    if not scheme.startswith("baseline."):
        assert_wire_and_calls_per_step(get_scheme(scheme).predict(case), per_rank)


@pytest.mark.parametrize("scheme,extra", [
    ("pipeline.1f1b", {}), ("pipeline.interleaved", {"vpp": "2"}),
    ("pipeline.1f1b", {"pack_docs": "3"})])
def test_the_pipeline_schedules_train_llama_blocks(pools, scheme, extra):
    """With packed documents the later stage's RoPE positions restart with them too."""
    case = case_for(scheme, PIPE, **extra)
    merged, per_rank = run_on_pool(pools, case)
    assert merged.equivalent, merged.first_failure
    assert_wire_and_calls_per_step(get_scheme(scheme).predict(case), per_rank)


CP = {"model": "llama-tiny", "dp": "1", "cp": "2", "num_microbatches": "2",
      "micro_batch_size": "1", "steps": "3", "timed_steps": "1"}


@pytest.mark.parametrize("scheme,extra", [
    ("context.ring-attention", {"cp_balance": "zigzag"}), ("context.ulysses", {}),
    ("context.allgather", {"cp_balance": "striped", "pack_docs": "3"}),
    ("context.usp", {"cp": "4", "cp_ulysses": "2", "cp_balance": "zigzag"}),
    # multi-head (its kernels move every head): RoPE in the rematerialised layer's backward
    # recomputation too
    ("context.distflashattn", {"cp": "4", "num_kv_heads": "4", "recompute": "full"})])
def test_the_context_family_rotates_at_global_positions(pools, scheme, extra):
    """RoPE on a sequence chunk at its tokens' global positions (within-document ones when
    packed), in each layout, with grouped-query attention (2 K/V heads for 4 query heads);
    byte-exact: the cores move K/V of the K/V heads only, as the closed forms count them;
    every rank's layer keeps the activation formula's bytes (``cp_block_keywords``)."""
    case = case_for(scheme, CP, **extra)
    merged, per_rank = run_on_pool(pools, case)
    assert merged.equivalent, merged.first_failure
    assert_wire_and_calls_per_step(get_scheme(scheme).predict(case), per_rank)
    assert_layer_activations(per_rank, "activation_bytes_per_layer",
                             "activation_bytes_per_layer_predicted")


@pytest.mark.parametrize("scheme", ["baseline.dtensor.tp", "context.distflashattn",
                                    "baseline.megatron.moe"])
def test_schemes_without_the_features_refuse_before_spawning(scheme):
    case = apply_overrides(CaseConfig(), {**BASE, "dp": "1", "scheme": scheme})
    with pytest.raises(ConfigError, match=f": scheme {scheme} does not run this LLaMA-style"):
        get_scheme(scheme).check(case)


def test_runnable_model_rules():
    # SwiGLU experts without biases (Mixtral's) run: the model is valid; a scheme that does
    # not run them refuses (test_expert_deepseek)
    validate_case(apply_overrides(CaseConfig(), {"model": "llama-tiny", "num_experts": "4"}))
    with pytest.raises(ConfigError, match="rope_theta=10000 needs an even head_dim"):
        validate_case(apply_overrides(CaseConfig(), {"model": "tiny", "hidden_size": "12",
                                                     "num_heads": "4", "rope_theta": "1e4"}))
