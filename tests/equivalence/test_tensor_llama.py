"""The native Megatron 1D schemes (``tensor.megatron``, ``tensor.megatron-sp``) on the LLaMA
blocks (RoPE, grouped-query attention with the query groups split over tp, SwiGLU, RMSNorm,
no biases) and on packed sequences, against the golden run; every step's bytes and calls equal
the closed forms (``analytic.tensor.megatron_params`` counts the LLaMA tensors). A padded
vocabulary (61 over tp=2) and selective recompute (the attention core recomputed with the
documents' mask) are covered; tp > num_kv_heads runs as Megatron-Core runs it (the QKV output
gathered), a tp that neither divides nor is a multiple of num_kv_heads is refused. The 2D,
2.5D and 3D grids run the same blocks (RMSNorm over the hidden group, SwiGLU's [gate_j; up_j]
column blocks, K/V heads with their query heads' column), bytes, calls and model states equal
to ``analytic.tensor_grid``'s closed forms; a grid whose q does not divide num_kv_heads is
refused."""
from __future__ import annotations

import pytest

from parbench.config import CaseConfig, ConfigError, validate_case
from parbench.overrides import apply_overrides
from parbench.registry import get_scheme
from tests.helpers import assert_layer_activations, assert_wire_and_calls_per_step, run_on_pool

TP = {"model": "llama-tiny", "vocab_size": "61", "dp": "1", "tp": "2", "num_microbatches": "2",
      "steps": "3", "timed_steps": "1"}


def case_for(scheme: str, **extra) -> CaseConfig:
    case = apply_overrides(CaseConfig(), {**TP, "scheme": scheme, **extra})
    validate_case(case)
    get_scheme(scheme).check(case)
    return case


@pytest.mark.parametrize("scheme,extra", [
    ("tensor.megatron", {}),
    ("tensor.megatron-sp", {}),
    ("tensor.megatron-sp", {"pack_docs": "3", "recompute": "selective"}),
    ("tensor.megatron", {"pack_docs": "3", "model": "tiny", "recompute": "full"}),
    ("tensor.megatron-sp", {"pack_docs": "3", "model": "tiny"})])
def test_megatron_1d_trains_llama_blocks_and_packed_documents(pools, scheme, extra):
    """Equal to the golden run (the GPT-2 cases: learned positions at the within-document
    positions, under sp the rank's rows of them), byte-exact against the closed forms; every
    rank's layer keeps the activation formula's bytes (the LLaMA blocks' terms; packed: the
    per-sample RoPE tables and, unless the core is recomputed, the kernel's mask)."""
    case = case_for(scheme, **extra)
    merged, per_rank = run_on_pool(pools, case)
    assert merged.equivalent, merged.first_failure
    assert_wire_and_calls_per_step(get_scheme(scheme).predict(case), per_rank)
    assert_layer_activations(per_rank)


@pytest.mark.parametrize("scheme,extra", [
    ("tensor.megatron", {"tp": "4"}),
    ("tensor.megatron-sp", {"tp": "4"}),
    ("tensor.megatron", {"num_kv_heads": "1", "recompute": "selective"})])
def test_tp_above_the_kv_heads_runs_as_megatron_core_does(pools, scheme, extra):
    """tp = 4 over 2 K/V heads and tp = 2 over 1 (issue 21): each rank holds a 1/t of the
    group-interleaved QKV rows, gathers the output and attends with its group's K/V head
    (``impls.tensor.gqa``); equal to the golden run, and the gather's bytes and calls are the
    closed form's (``analytic.gqa.qkv_gather_transfers``); a layer keeps the formula's bytes
    at K/V max(g, t) d wide (``reference_block_keywords``: each rank one K/V head)."""
    case = case_for(scheme, **extra)
    merged, per_rank = run_on_pool(pools, case)
    assert merged.equivalent, merged.first_failure
    assert_wire_and_calls_per_step(get_scheme(scheme).predict(case), per_rank)
    assert_layer_activations(per_rank)


def test_tp_and_kv_heads_that_do_not_divide_each_other_are_refused():
    with pytest.raises(ConfigError, match="num_kv_heads=3"):
        case_for("tensor.megatron", hidden_size="48", num_heads="6", num_kv_heads="3")


#: the grids' shapes (suites/tensor.yaml): tp = 8 needs 8 query heads (still 2 K/V heads)
GRID8 = {"tp": "8", "micro_batch_size": "4", "num_heads": "8", "hidden_size": "64"}


@pytest.mark.parametrize("scheme,extra", [
    ("tensor.2d", {"tp": "4"}),
    ("tensor.2.5d", {**GRID8, "tp_depth": "2", "pack_docs": "3"}),
    ("tensor.3d", GRID8)])
def test_grids_train_llama_blocks_byte_and_state_exact(pools, scheme, extra):
    """q = 2 columns over 2 K/V heads; 2.5D with packed documents (RoPE restarted with
    them). Equal to the golden run; every rank's bytes, calls and model states per step are
    the closed forms'; a layer's saved activations are the grid's activation form
    (``analytic.tensor_grid``; packed: each sample's RoPE tables and the kernel's mask)."""
    case = case_for(scheme, steps="2", timed_steps="0", **extra)
    merged, per_rank = run_on_pool(pools, case)
    assert merged.equivalent, merged.first_failure
    pred = get_scheme(scheme).predict(case)
    assert_wire_and_calls_per_step(pred, per_rank)
    for r in per_rank:
        assert all(s == pred.model_state_bytes[r.rank] for s in r.model_states_per_step)
    assert_layer_activations(per_rank)


@pytest.mark.parametrize("scheme,extra", [("tensor.2d", {"tp": "4"}), ("tensor.3d", GRID8)])
def test_grids_refuse_kv_heads_their_columns_cannot_hold(scheme, extra):
    with pytest.raises(ConfigError, match="num_kv_heads=1 is not a multiple of the grid's q=2"):
        case_for(scheme, num_kv_heads="1", **extra)
