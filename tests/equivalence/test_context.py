"""Context-parallel family on real gloo ranks: Ring Self-Attention, Ring Attention (three
layouts), Ulysses, USP and all-gather CP against the golden run, with every rank's wire bytes,
calls and model states equal to ``analytic.context`` on every checked step, and the measured
activation bytes of a layer equal to the formula on the sequence shard.

Hypothesis draws the scheme, the model shape (heads, K/V heads, head size, layers, an odd
vocabulary), the sequence length, cp (2 or 4), dp x cp, the layout, USP's Ulysses degree,
recomputation and micro-batching. Every example runs on the session's pool for its world
size.
"""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from parbench.config import CaseConfig, ConfigError, validate_case
from parbench.overrides import apply_overrides
from parbench.registry import all_schemes, get_scheme
from tests.helpers import assert_layer_activations, run_on_pool

#: the context family's measured and predicted bytes of a layer (``impls.context.base``)
CP_ACTIVATIONS = ("activation_bytes_per_layer", "activation_bytes_per_layer_predicted")

# Parameters after AdamW are compared with atol 1e-3 = lr (losses and gradients keep the strict
# defaults, rtol 1e-5 / atol 1e-6 at step 0): AdamW's first update is lr g/(|g| + eps), so an
# element whose gradient is of the order of eps (1e-8) turns the fp32 reduction-order noise d
# of a re-ordered attention sum into an update difference of up to lr d/(4 eps) -- seen:
# 1.08e-4 on one fc1 weight, cp=4, one 16-token sample. Optimizer bugs are caught by the
# update check (a few ulps), gradient bugs by the step-0 gradients.
PARAM_ATOL = 1e-3

SCHEMES = ("context.ring-self-attention", "context.ring-attention", "context.ulysses",
           "context.usp", "context.allgather")


def make_case(scheme: str, **ov) -> CaseConfig:
    base = {"scheme": scheme, "model": "tiny", "steps": "3", "timed_steps": "0",
            "micro_batch_size": "2", "num_microbatches": "1", "param_atol": str(PARAM_ATOL)}
    case = apply_overrides(CaseConfig(), {**base, **{k: str(v) for k, v in ov.items()}})
    validate_case(case)
    get_scheme(scheme).check(case)
    return case


def assert_exact(case, per_rank) -> None:
    """Every rank's model states, wire bytes and calls per axis equal the closed form's on
    every checked step; the layer's saved activations equal the formula's (GPT-2 and LLaMA
    blocks: ``analytic.context.cp_block_keywords``)."""
    pred = get_scheme(case.run.scheme).predict(case)
    for r in per_rank:
        for step, states in enumerate(r.model_states_per_step):
            assert states == pred.model_state_bytes[r.rank], (r.rank, step, states)
        for step, (wire, calls) in enumerate(zip(r.wire_by_axis_per_step,
                                                 r.calls_by_axis_per_step)):
            want_w, want_c = pred.wire_at(step)[r.rank], pred.calls_at(step)[r.rank]
            for axis in set(wire) | set(want_w):
                assert wire.get(axis, 0.0) == want_w.get(axis, 0.0), (r.rank, step, axis, wire)
            assert {a: c for a, c in calls.items() if c} == want_c, (r.rank, step, calls)
    assert_layer_activations(per_rank, *CP_ACTIVATIONS)


@st.composite
def cases(draw):
    scheme = draw(st.sampled_from(SCHEMES))
    cp = draw(st.sampled_from([2, 4]))
    dp = draw(st.sampled_from([1, 2])) if cp == 2 else 1
    heads = draw(st.sampled_from([2, 4]))
    u = 1
    if scheme == "context.ulysses":
        heads = max(heads, cp)
    if scheme == "context.usp":
        u = draw(st.sampled_from([d for d in (1, 2, 4) if cp % d == 0 and heads % d == 0]))
    # grouped-query attention: K/V heads dividing the query heads (and Ulysses' degree)
    shards = cp if scheme == "context.ulysses" else u
    kv = draw(st.sampled_from([g for g in (1, 2, 4) if heads % g == 0 and g % shards == 0]))
    head_dim = draw(st.sampled_from([4, 8]))
    return make_case(
        scheme, cp=cp, dp=dp, num_heads=heads, num_kv_heads=kv, hidden_size=heads * head_dim,
        num_layers=draw(st.integers(1, 2)), vocab_size=draw(st.sampled_from([61, 96])),
        seq_length=2 * cp * draw(st.integers(1, 3)), cp_ulysses=u,
        cp_balance=draw(st.sampled_from(["none", "zigzag", "striped"])),
        recompute=draw(st.sampled_from(["none", "selective", "full"])),
        num_microbatches=draw(st.integers(1, 2)), micro_batch_size=draw(st.integers(1, 2)))


@given(case=cases())
def test_context_schemes_match_golden_with_exact_bytes(pools, case):
    merged, per_rank = run_on_pool(pools, case)
    assert merged.equivalent, (merged.max_loss_abs, merged.max_grad_abs, merged.max_param_abs)
    assert not merged.uncovered
    assert_exact(case, per_rank)


def test_ring_attention_clips_by_the_global_norm(pools):
    """clip_grad=0.5 (below the tiny model's norm, about 1.0: every step clips): after the
    all-reduce over cp every rank holds the whole averaged gradient, so the norm is local --
    the clipped gradients match the golden run's and the bytes stay the closed form's (no
    collective added)."""
    case = make_case("context.ring-attention", cp=2, num_microbatches=2, clip_grad=0.5)
    merged, per_rank = run_on_pool(pools, case)
    assert merged.equivalent, (merged.max_loss_abs, merged.max_grad_abs, merged.max_param_abs)
    assert not merged.uncovered
    assert_exact(case, per_rank)
    assert merged.clipped_steps and merged.clipped_steps > 0, merged.clip_coef_min


def test_ring_hops_on_gloo_are_all_to_alls_of_one_block(pools):
    """On gloo a ring hop is one all-to-all whose only non-empty splits are the neighbours'
    (``RingPeers``; issue 24: an isend/irecv hop cost ~10 times as much): every cp call of
    the checked step is an all-to-all moving one K/V (or dK/dV) block, 2 b (s/cp) h bytes,
    and the ring still turns the right way at cp=4 (equivalent, bytes and calls exact)."""
    case = make_case("context.ring-attention", cp=4, cp_balance="zigzag")
    merged, per_rank = run_on_pool(pools, case)
    assert merged.equivalent, merged.first_failure
    assert_exact(case, per_rank)
    m = case.model
    block = 2 * case.layout.micro_batch_size * (m.seq_length // 4) * m.hidden_size * 4
    for r in per_rank:
        cp = [(c["op"], c["wire_bytes"]) for c in r.ledger if c["axis"] == "cp"]
        assert cp and set(cp) == {("all_to_all", block)}, (r.rank, cp)


def test_ring_self_attention_runs_grouped_query_attention(pools):
    """LLaMA blocks with 8 query heads over 2 K/V heads (each K/V head serves 4 consecutive
    query heads), packed documents: K and V travel the ring at the K/V heads' width and dK,
    dV are all-reduced at it, bytes and calls equal to the closed form's; the layer's saved
    activations (RMSNorm, RoPE tables, SwiGLU, the score rows) the formula's."""
    case = make_case("context.ring-self-attention", cp=4, model="llama-tiny", num_heads=8,
                     num_kv_heads=2, pack_docs=3, micro_batch_size=1, num_microbatches=2)
    merged, per_rank = run_on_pool(pools, case)
    assert merged.equivalent, merged.first_failure
    assert not merged.uncovered
    assert_exact(case, per_rank)


def test_bad_input_fails_before_spawning_with_one_line():
    cases_and_rules = [
        ("context.ulysses", {"cp": 4, "num_heads": 2, "hidden_size": 16},
         "cp=4 does not divide num_heads=2"),
        ("context.usp", {"cp": 4, "cp_ulysses": 3}, "cp_ulysses=3 does not divide cp=4"),
        ("context.usp", {"cp": 4, "cp_ulysses": 4, "num_heads": 2, "hidden_size": 16},
         "cp_ulysses=4 does not divide num_heads=2"),
        ("context.ring-attention", {"cp": 4, "seq_length": 12, "cp_balance": "zigzag"},
         "2\\*4 to divide seq_length=12"),
        ("context.allgather", {"cp": 2, "dtype": "bf16"}, "fp32 only"),
        ("context.ring-attention", {"cp": 2, "tp": 2}, "tp=2 is not used"),
    ]
    for scheme, ov, rule in cases_and_rules:
        with pytest.raises(ConfigError, match=rule) as err:
            make_case(scheme, **ov)
        assert "\n" not in str(err.value)


def test_every_context_scheme_is_registered_with_its_options():
    names = {n for n, c in all_schemes().items() if c.family == "context"}
    assert set(SCHEMES) <= names
    assert get_scheme("context.usp").options == ("cp_balance", "cp_ulysses", "recompute")


def test_load_balancing_evens_out_the_causal_work(pools):
    """The unbalanced causal ring makes the last rank do ~(2N-1)/N of the mean's work; zig-zag
    and striped layouts remove it. Measured as each rank's attention-kernel CPU time (thread
    time, so ranks sharing cores do not blur it) beside the closed form."""
    figures = {}
    for balance in ("none", "zigzag"):
        case = make_case("context.ring-attention", cp=4, cp_balance=balance, hidden_size=64,
                         seq_length=512, num_layers=1, steps=1, timed_steps=3)
        merged, per_rank = run_on_pool(pools, case)
        assert merged.equivalent
        figures[balance] = per_rank[0].metrics
    none, zig = figures["none"], figures["zigzag"]
    assert none["attention_imbalance_predicted"] == pytest.approx(1.75, abs=0.01)
    assert zig["attention_imbalance_predicted"] == 1.0
    times = [float(t) for t in none["attention_cpu_ms_per_cp_rank"].split(" / ")]
    assert times[-1] > 1.5 * times[0], times
    assert none["attention_imbalance"] > zig["attention_imbalance"] + 0.15, (none, zig)


@pytest.mark.skipif("tensor.megatron-sp" not in all_schemes(), reason="no tensor.megatron-sp")
def test_issue_4217_ulysses_moves_p_times_fewer_bytes_than_megatron_sp(pools):
    """DeepSpeed issue 4217 by measurement: one layer's bytes per rank (the difference of a 2-
    and a 1-layer step on the scheme's own axis) at degree 2 on the same b x s x h."""
    def per_layer(scheme, axis):
        wire = {}
        for layers in (1, 2):
            case = make_case(scheme, **{axis: 2}, hidden_size=64, seq_length=64,
                             num_layers=layers, micro_batch_size=1, steps=1)
            merged, _ = run_on_pool(pools, case)
            assert merged.equivalent
            wire[layers] = merged.wire_by_axis[0][axis]
        return wire[2] - wire[1]
    from parbench.analytic.context import ulysses_vs_megatron_sp
    f = ulysses_vs_megatron_sp(1, 64, 64, 2)
    ulysses = per_layer("context.ulysses", "cp")
    megatron_sp = per_layer("tensor.megatron-sp", "tp")
    # Ulysses' backward mirrors its forward: the step is twice the 4(P-1)/P^2 bsh forward
    assert ulysses == 2 * f["ulysses_fwd_bytes_per_layer"]
    # Megatron-SP's forward alone is P times Ulysses' (its backward adds re-gathers)
    assert megatron_sp >= 2 * f["megatron_sp_fwd_bytes_per_layer"] == 2 * 2 * ulysses / 2
    assert megatron_sp / ulysses >= 2
