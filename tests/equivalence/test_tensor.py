"""Tensor-parallel family on real gloo ranks: Megatron 1D and sequence parallelism, 2D, 2.5D
and 3D against their golden runs, with every rank's measured wire bytes, calls and model
states equal to ``predict()`` (the closed forms of ``parbench.analytic.tensor``) on every
checked step, and the activation bytes of a layer equal to the adapted Korthikanti formula.

Hypothesis draws the scheme, tp, heads, head size, layers, vocabulary (odd sizes and sizes
below tp included: padded and masked), sequence length, micro-batches, tied embeddings and
recomputation. Every example runs on the session's pool for its world size.
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parbench.config import CaseConfig, ConfigError, validate_case
from parbench.overrides import apply_overrides
from parbench.registry import get_scheme
from tests.helpers import run_on_pool

# Parameters after AdamW: atol 1e-4 (see tests/equivalence/test_data.py, FP32_PARAM_ATOL);
# losses and gradients keep the strict defaults (rtol 1e-5, atol 1e-6).
PARAM_ATOL = 1e-4


def make_case(scheme: str, tp: int, heads: int = 4, head_dim: int = 8, layers: int = 1,
              vocab: int = 61, seq: int = 8, mbs: int = 2, m: int = 1, **extra) -> CaseConfig:
    h = heads * head_dim
    ov = {"scheme": scheme, "tp": tp, "num_heads": heads, "hidden_size": h,
          "ffn_hidden_size": 4 * h, "num_layers": layers, "vocab_size": vocab,
          "seq_length": seq, "micro_batch_size": mbs, "num_microbatches": m, "steps": 2,
          "timed_steps": 0, "param_atol": PARAM_ATOL, **extra}
    case = apply_overrides(CaseConfig(), {k: str(v).lower() if isinstance(v, bool) else str(v)
                                          for k, v in ov.items()})
    validate_case(case, tp)
    get_scheme(scheme).check(case)
    return case


def assert_exact(case, merged, per_rank):
    """Every rank: model states (nothing 'other'), wire bytes and calls per axis equal the
    closed form's on every checked step; a layer's saved activations equal the formula."""
    assert merged.equivalent, (f"loss {merged.max_loss_abs:.3g} grad {merged.max_grad_abs:.3g} "
                               f"param {merged.max_param_abs:.3g} {merged.uncovered[:3]}")
    pred = get_scheme(case.run.scheme).predict(case)
    for r in per_rank:
        for states in r.model_states_per_step:
            assert states == pred.model_state_bytes[r.rank], (r.rank, states)
        for step, (wire, calls) in enumerate(zip(r.wire_by_axis_per_step,
                                                 r.calls_by_axis_per_step)):
            want_wire, want_calls = pred.wire_at(step)[r.rank], pred.calls_at(step)[r.rank]
            assert {a: w for a, w in wire.items() if w} == want_wire, (r.rank, step, wire)
            assert {a: c for a, c in calls.items() if c} == want_calls, (r.rank, step, calls)
        assert r.metrics["act_layer_bytes"] == r.metrics["act_layer_formula"], r.metrics
    return pred


megatron_cases = st.fixed_dictionaries({
    "scheme": st.sampled_from(["tensor.megatron", "tensor.megatron-sp"]),
    "tp": st.sampled_from([1, 2, 4]),
    "heads": st.sampled_from([4, 8]),
    "head_dim": st.sampled_from([4, 8]),
    "layers": st.integers(1, 2),
    "vocab": st.sampled_from([3, 61, 64, 97]),
    "seq": st.sampled_from([8, 12]),
    "m": st.integers(1, 2),
    "tie_embeddings": st.booleans(),
    "recompute": st.sampled_from(["none", "selective", "full"]),
})


@given(c=megatron_cases)
@settings(max_examples=8)
def test_megatron_matches_golden_with_exact_bytes(pools, c):
    if c["scheme"] == "tensor.megatron-sp" and c["seq"] % c["tp"]:
        c = {**c, "seq": 8}
    case = make_case(**c)
    merged, per_rank = run_on_pool(pools, case)
    assert_exact(case, merged, per_rank)
    # Megatron 1D relies on identical replicated gradients on every tp rank (LayerNorms,
    # row-parallel biases, positions); sequence parallelism makes them so by its all-reduce
    assert per_rank[0].metrics["replicated_grad_max_diff"] == 0.0


def test_sequence_parallel_moves_tp_bytes_plus_the_regather(pools):
    """Korthikanti et al. Sec. 4.2.2: sequence parallelism replaces each all-reduce by an
    all-gather and a reduce-scatter of the same size -- the same layer bytes -- and its
    column-parallel linears, keeping only the sequence shard, all-gather it again in
    backward: 2 (t-1)/t S more per layer. Its layer activations are smaller (Eq. 3)."""
    from fractions import Fraction
    rows = {}
    for scheme in ("tensor.megatron", "tensor.megatron-sp"):
        case = make_case(scheme, 2, layers=2)
        merged, per_rank = run_on_pool(pools, case)
        assert_exact(case, merged, per_rank)
        rows[scheme] = (per_rank[0], get_scheme(scheme).predict(case))
    tp_rank, tp_pred = rows["tensor.megatron"]
    sp_rank, sp_pred = rows["tensor.megatron-sp"]
    layers = lambda pred: [t for t in pred.figures["transfers"] if t["what"].startswith("layers")]  # noqa: E731
    tp_layer = sum(Fraction(t["total_wire_bytes"]) for t in
                   [t for t in tp_pred.figures["transfers"] if "g (fwd)" in t["what"]])
    sp_layer = sum(Fraction(t["total_wire_bytes"]) for t in layers(sp_pred))
    S = 2 * 8 * 32 * 4  # noqa: N806 -- b s h e
    regather = 2 * 2 * Fraction(1, 2) * S  # 2 layers x 2 all-gathers x (t-1)/t S
    assert sp_layer == tp_layer + regather
    assert sp_rank.metrics["act_layer_bytes"] < tp_rank.metrics["act_layer_bytes"]


def test_sequence_parallel_clips_by_the_global_norm(pools):
    """clip_grad=0.5 (the tiny model's norm is about 1.0, so every step clips): the shards'
    squares and the tp-replicated parameters' once (tp rank 0) summed over tp, after the
    LayerNorm gradients' all-reduce; the clipped gradients match the golden run's and the
    norm's one 4-byte all-reduce per step is in the closed form ('=')."""
    case = make_case("tensor.megatron-sp", 2, m=2, clip_grad=0.5)
    merged, per_rank = run_on_pool(pools, case)
    pred = assert_exact(case, merged, per_rank)
    assert merged.clipped_steps and merged.clipped_steps > 0, merged.clip_coef_min
    assert any(t["what"] == "gradient norm (clipping)" for t in pred.figures["transfers"])


grid_cases = st.fixed_dictionaries({
    "scheme": st.sampled_from(["tensor.2d", "tensor.2.5d"]),
    "tp_depth": st.sampled_from([1, 4]),
    "heads": st.sampled_from([4, 8]),
    "head_dim": st.sampled_from([4, 8]),
    "layers": st.integers(1, 2),
    "vocab": st.sampled_from([5, 61]),
    "m": st.integers(1, 2),
    "tie_embeddings": st.booleans(),
})


@given(c=grid_cases)
@settings(max_examples=4)
def test_2d_and_2p5d_match_golden_with_exact_bytes(pools, c):
    depth = 1 if c["scheme"] == "tensor.2d" else c["tp_depth"]
    extra = {"tp_depth": depth} if c["scheme"] == "tensor.2.5d" else {}
    case = make_case(c["scheme"], 4, c["heads"], c["head_dim"], c["layers"], c["vocab"],
                     mbs=4, m=c["m"], tie_embeddings=c["tie_embeddings"], **extra)
    merged, per_rank = run_on_pool(pools, case)
    assert_exact(case, merged, per_rank)


def test_3d_on_a_cube_of_eight_ranks(pools):
    case = make_case("tensor.3d", 8, heads=8, head_dim=8, vocab=61, mbs=4)
    merged, per_rank = run_on_pool(pools, case)
    pred = assert_exact(case, merged, per_rank)
    assert set(pred.wire_bytes[0]) == {"tp_x", "tp_y", "tp_z"}


@pytest.mark.parametrize("scheme,tp,extra,match", [
    ("tensor.2d", 2, {}, "not q\\^2"),
    ("tensor.3d", 4, {}, "not a cube"),
    ("tensor.2.5d", 4, {"tp_depth": 3}, "tp_depth=3 does not divide"),
    ("tensor.2d", 4, {"micro_batch_size": 1}, "does not divide micro_batch_size=1"),
    ("tensor.megatron-sp", 4, {"seq_length": 6}, "seq_length=6"),
    ("tensor.megatron", 2, {"dtype": "bf16"}, "fp32 only"),
])
def test_bad_grids_are_refused_before_spawning(scheme, tp, extra, match):
    ov = {"scheme": scheme, "tp": tp, "model": "tiny", **extra}
    case = apply_overrides(CaseConfig(), {k: str(v) for k, v in ov.items()})
    with pytest.raises(ConfigError, match=match):
        validate_case(case)
        get_scheme(scheme).check(case)
