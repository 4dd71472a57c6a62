"""Data-parallel family on real gloo ranks: native DDP, ZeRO-1/2/3 and local SGD against their
golden runs, with measured model-state and wire bytes equal to ``predict()`` byte for byte.

Hypothesis draws the model shape (hidden size, layers, heads), the world size 1-4, the
bucket / unit size, the number of accumulated micro-batches and the ZeRO stage. Every example
runs on the session's pool for its world size (``tests/conftest.py``).
"""
from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parbench.config import CaseConfig, validate_case
from parbench.overrides import apply_overrides
from parbench.registry import get_scheme
from tests.helpers import run_on_pool

# bucket sizes in MiB: ~1 layer per unit, a few layers per unit, the whole model in one unit
BUCKETS = (0.002, 0.02, 1.0)

shapes = st.fixed_dictionaries({
    "num_heads": st.sampled_from([1, 2, 4]),
    "head_dim": st.sampled_from([4, 8]),
    "num_layers": st.integers(1, 3),
    "vocab_size": st.sampled_from([61, 96]),
})


# Parameters after AdamW are compared with atol 1e-4 instead of the default 1e-5 (losses and
# gradients keep the strict defaults, rtol 1e-5 / atol 1e-6). AdamW's update lr*g/(|g|+eps)
# turns a reduction-order difference delta in a gradient element near zero into an update
# difference up to lr*delta/eps: with delta ~ 1e-9 (fp32 sums of O(1e-2) gradients in another
# order), lr = 1e-3, eps = 1e-8 that is ~1e-4. Native and torch DDP show the same 1.7e-5 as
# ZeRO on e.g. d = 3, one layer (fc2.weight, step 0), so it is the comparison, not a scheme.
FP32_PARAM_ATOL = 1e-4


def make_case(scheme: str, shape: dict, world: int, bucket_mb: float, m: int,
              **extra) -> CaseConfig:
    extra.setdefault("param_atol", FP32_PARAM_ATOL)
    ov = {"scheme": scheme, "dp": world, "bucket_mb": bucket_mb, "num_microbatches": m,
          "num_heads": shape["num_heads"], "hidden_size": shape["num_heads"] * shape["head_dim"],
          "ffn_hidden_size": 4 * shape["num_heads"] * shape["head_dim"],
          "num_layers": shape["num_layers"], "vocab_size": shape["vocab_size"],
          "seq_length": 8, "micro_batch_size": 2, "steps": 3, **extra}
    case = apply_overrides(CaseConfig(), {k: str(v) for k, v in ov.items()})
    validate_case(case, world)
    get_scheme(scheme).check(case)
    return case


def assert_bytes_exact(case, merged, per_rank):
    """Every rank's model states (as the tracker attributes them, nothing 'other'), wire
    bytes and calls equal the closed form's, on every checked step."""
    pred = get_scheme(case.run.scheme).predict(case)
    for r in per_rank:
        for states in r.model_states_per_step:
            assert states == pred.model_state_bytes[r.rank], (r.rank, states, pred)
        for step, (wire, calls) in enumerate(zip(r.wire_by_axis_per_step,
                                                 r.calls_by_axis_per_step)):
            assert wire.get("dp", 0.0) == pred.wire_at(step)[r.rank]["dp"], (step, wire)
            assert calls.get("dp", 0) == pred.calls_at(step)[r.rank]["dp"], (step, calls)
    return pred


def summary(merged) -> str:
    return (f"loss {merged.max_loss_abs:.3g} grad {merged.max_grad_abs:.3g} "
            f"param {merged.max_param_abs:.3g} uncovered {merged.uncovered[:3]}")


# ---- ZeRO ----------------------------------------------------------------------------------


@given(shape=shapes, world=st.integers(1, 4), bucket=st.sampled_from(BUCKETS),
       m=st.integers(1, 3), stage=st.sampled_from([1, 2, 3]))
def test_zero_matches_golden_with_exact_bytes(pools, shape, world, bucket, m, stage):
    case = make_case(f"zero.{stage}", shape, world, bucket, m)
    merged, per_rank = run_on_pool(pools, case)
    assert merged.equivalent, summary(merged)
    pred = assert_bytes_exact(case, merged, per_rank)
    # every collective is one whole padded unit, issued as the prediction lists it
    led = [r for r in per_rank[0].ledger if r["group_size"] > 1]
    assert len(led) == pred.calls[0]["dp"]
    if world > 1:
        assert sum(r["message_bytes"] for r in led) == pred.figures["message_bytes"]["dp"]


@pytest.mark.parametrize("m", [1, 2])
def test_zero3_moves_one_and_a_half_times_zero12(pools, m):
    """Sec. 7.2 of the ZeRO paper: 3 Psi for ZeRO-3 against 2 Psi for ZeRO-1/2 (and DDP),
    padding included (d = 3 pads every unit). With m micro-batches ZeRO-3 gathers and reduces
    per micro-batch (3 m Psi'), ZeRO-2 reduce-scatters per micro-batch ((m + 1) Psi')."""
    shape = {"num_heads": 2, "head_dim": 8, "num_layers": 2, "vocab_size": 61}
    wire, peak = {}, {}
    for scheme in ("zero.1", "zero.2", "zero.3", "data.ddp"):
        case = make_case(scheme, shape, 3, 0.002, m)
        merged, per_rank = run_on_pool(pools, case)
        assert merged.equivalent, (scheme, summary(merged))
        wire[scheme] = Fraction(merged.wire_by_axis[0]["dp"])
        peak[scheme] = max(merged.peak_bytes)
    z = get_scheme("zero.1").predict(case)
    z = z.figures
    assert z["padded_params"] % 3 == 0 and z["padded_params"] > z["params"]
    assert wire["zero.3"] == Fraction(3 * m, 2) * wire["zero.1"]
    assert wire["zero.2"] == Fraction(m + 1, 2) * wire["zero.1"]
    if m == 1:
        assert wire["zero.3"] == Fraction(3, 2) * wire["zero.2"]
    # ZeRO-1/2 move DDP's volume, up to the padding: 2(d-1)/d Psi' against 2(d-1)/d Psi
    assert float(wire["zero.1"] * z["params"]) == pytest.approx(
        float(wire["data.ddp"] * z["padded_params"]), rel=1e-12)
    # each stage holds less: measured peak per rank falls stage by stage
    assert peak["data.ddp"] > peak["zero.1"] > peak["zero.2"] > peak["zero.3"]


# bf16 compute against the fp32 golden run: losses and gradients are held, tensor by tensor and
# step by step, to the tolerance derived from the step's own bf16 rounding noise
# (parbench.verdict.precision), and so are the final parameters after the timed steps (the
# continuation in bf16 against the same in fp32). param_atol stays stated for the drift shown
# beside them: 2 * lr per step, as AdamW moves an element whose gradient is within the bf16
# noise by up to lr in either run (Kingma & Ba 2015, Sec. 2.1).
BF16_FINAL_PARAM_ATOL = 2 * 1e-3 * 3
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_bf16_mixed_precision(pools, stage):
    shape = {"num_heads": 2, "head_dim": 8, "num_layers": 2, "vocab_size": 96}
    case = make_case(f"zero.{stage}", shape, 2, 0.002, 2, dtype="bf16",
                     param_atol=BF16_FINAL_PARAM_ATOL)
    merged, per_rank = run_on_pool(pools, case)
    assert merged.equivalent, summary(merged)
    # the derived tolerances held every tensor to a fraction of its own scale (the stated
    # atol 1e-2 of before let a tensor of scale 1e-3 through whole)
    assert 0 < merged.detectable_grad_error < 1
    pred = assert_bytes_exact(case, merged, per_rank)
    # bf16 parameters and gradients, fp32 master + moments: the paper's 2 + 2 + 12
    s = pred.figures["shard_params"]
    assert pred.model_state_bytes[0]["optimizer"] == 12 * s + 4 * pred.figures["units"]


def test_zero_bf16_final_tolerance_after_many_timed_steps(pools):
    """Issue 20 sec. 4: after 12 timed steps a correct bf16 scheme passes the final check at
    the tolerance derived from the timed steps' own noise (the stated 6e-3 failed it: 7.2e-3
    on qkv.bias), and a scheme whose optimizer loses its moments after the checked steps
    (same traffic: only the final check sees it) still fails it."""
    from parbench.mutation import base_case
    from parbench.selftest import load
    shape = {"num_heads": 4, "head_dim": 8, "num_layers": 2, "vocab_size": 128}
    case = make_case("zero.1", shape, 2, 0.01, 1, dtype="bf16", timed_steps=12,
                     warmup_steps=0)
    merged, _ = run_on_pool(pools, case)
    assert merged.equivalent, summary(merged)
    assert 0 < merged.final_max_abs <= merged.final_param_tol
    m = load()["zero1-bf16-optimizer-reset-after-checked"]
    merged, per_rank = run_on_pool(pools, base_case(m, m.scheme, 0))
    assert merged.golden_ok is False and merged.update_ok, summary(merged)
    assert all(r.final and not r.final.param_ok for r in per_rank)


def test_zero3_rejects_tied_embeddings():
    from parbench.config import ConfigError
    case = apply_overrides(CaseConfig(), {"model": "tiny", "dp": "2", "scheme": "zero.3",
                                          "tie_embeddings": "true"})
    with pytest.raises(ConfigError, match="tie_embeddings"):
        get_scheme("zero.3").check(case)


# ---- native DDP --------------------------------------------------------------------------
# Native DDP's golden equivalence, exact bytes and bucket overlap are tested in
# tests/equivalence/test_ddp.py; here DDP appears beside ZeRO (same volume up to padding) in
# test_zero3_moves_one_and_a_half_times_zero12.


# ---- local SGD -----------------------------------------------------------------------------


@given(world=st.integers(1, 4), period=st.integers(1, 3), m=st.integers(1, 2),
       steps=st.integers(3, 4))
@settings(max_examples=4)
def test_local_sgd_matches_simulated_workers(pools, world, period, m, steps):
    shape = {"num_heads": 2, "head_dim": 8, "num_layers": 1, "vocab_size": 61}
    case = make_case("data.local_sgd", shape, world, 1.0, m, local_sgd_period=period,
                     steps=steps)
    merged, per_rank = run_on_pool(pools, case)
    assert merged.equivalent, summary(merged)
    assert not merged.uncovered
    pred = get_scheme("data.local_sgd").predict(case)
    for r in per_rank:
        assert r.model_state_bytes == pred.model_state_bytes[r.rank]
        # every step, the timed ones included (the prediction covers them: issue 20)
        got = [w.get("dp", 0.0) for w in r.wire_by_axis_per_step]
        assert got == [w[r.rank]["dp"] for w in pred.wire_bytes_by_step]


@pytest.mark.parametrize("scheme", ["zero.2", "data.ddp"])
def test_data_parallel_runs_multi_head_latent_attention(pools, scheme):
    """``mla-tiny`` (feature mla, issue 21): the ranks run the reference model, so the data
    family trains MLA as the golden run does; the gradient bytes are the closed form's MLA
    parameter count (``analytic.params.mla_linears``)."""
    ov = {"scheme": scheme, "model": "mla-tiny", "dp": "2", "num_microbatches": "2",
          "steps": "3", "param_atol": str(FP32_PARAM_ATOL)}
    case = apply_overrides(CaseConfig(), ov)
    validate_case(case, 2)
    get_scheme(scheme).check(case)
    merged, per_rank = run_on_pool(pools, case)
    assert merged.equivalent, summary(merged)
    assert_bytes_exact(case, merged, per_rank)
