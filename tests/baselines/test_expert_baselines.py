"""DeepSpeed-MoE (``deepspeed.moe.layer.MoE`` + engine) and Megatron-Core's ``MoELayer`` on
the cases where their semantics are the reference's: each equals the golden run and
``expert.alltoall``. DeepSpeed's all-to-alls and gradient reductions are exactly the closed
form of ours (4 all-to-alls of the [E, C, h] buffer per MoE layer per micro-batch; dense over
dp, experts over edp); Megatron's carry the gate probabilities as well (6 per layer per
micro-batch). Where DeepSpeed differs -- the kept subset of an over-full expert's tokens --
the difference is shown on its gate alone.
"""
from __future__ import annotations

import pytest
import torch

from impls.baselines.megatron_gpt_moe import DEEPSEEK_TINY
from parbench.config import CaseConfig, ConfigError
from parbench.model.moe import route
from parbench.overrides import apply_overrides
from parbench.registry import get_scheme
from tests.helpers import run_on_pool

BASE = {"model": "tiny", "num_experts": "4", "num_microbatches": "2", "steps": "3",
        "timed_steps": "0", "ep": "2", "dp": "2", "moe_capacity_factor": "0"}
LOSS_AGREE = 1e-5


def case_for(scheme: str, **ov) -> CaseConfig:
    case = apply_overrides(CaseConfig(), {**BASE, "scheme": scheme,
                                          **{k: str(v) for k, v in ov.items()}})
    get_scheme(scheme).check(case)
    return case


def test_deepspeed_moe_equals_golden_and_native_with_our_bytes(pools):
    pytest.importorskip("deepspeed")
    assert get_scheme("baseline.deepspeed.moe").isolated
    ours, _ = run_on_pool(pools, case_for("expert.alltoall"))
    case = case_for("baseline.deepspeed.moe")
    theirs, per_rank = run_on_pool(pools, case)  # isolated: fresh ranks
    assert ours.equivalent and theirs.equivalent
    for a, b in zip(ours.losses, theirs.losses):
        assert abs(a - b) <= LOSS_AGREE * abs(a), (ours.losses, theirs.losses)
    pred = get_scheme("expert.alltoall").predict(case)
    for r in per_rank:  # DeepSpeed's all-to-alls and reductions: exactly our closed form
        wire = {a: v for a, v in r.wire_by_axis_per_step[-1].items() if v}
        assert wire == pred.wire_bytes[r.rank]
        calls = {a: c for a, c in r.calls_by_axis_per_step[-1].items() if c}
        assert calls == pred.calls[r.rank]
    print("deepspeed moe: wire", theirs.wire_by_axis[0], "states",
          theirs.model_state_bytes[0], "ours", ours.model_state_bytes[0])


def test_deepspeed_moe_rejects_cases_it_computes_differently():
    for ov, rule in [({"moe_capacity_factor": 1.0}, "would drop tokens in another order"),
                     ({"moe_z_loss_coef": 1e-3}, "no router z-loss"),
                     ({"moe_top_k": 2}, "first choices only"),
                     ({"moe_top_k": 3}, "top-1 or top-2")]:
        with pytest.raises(ConfigError, match=rule):
            case_for("baseline.deepspeed.moe", **ov)
    case_for("baseline.deepspeed.moe", moe_top_k=2, moe_aux_loss_coef=0)  # comparable


def test_deepspeed_top1_keeps_another_subset_of_an_overfull_expert():
    """Why dropping cases are excluded: DeepSpeed's top-1 gate (``use_rts=False``) keeps the
    ``torch.topk`` of a 0/1 mask over the tokens, an implementation-defined subset, where the
    reference keeps the first C tokens in position order; with room for every token the two
    agree."""
    pytest.importorskip("deepspeed")
    from impls.baselines.deepspeed_zero import _import_deepspeed
    _import_deepspeed()
    from deepspeed.moe.sharded_moe import top1gating
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(32, 8, generator=g), torch.randn(4, 8, generator=g)
    groups = torch.zeros(32, dtype=torch.long)
    for cf, same in [(1.0, False), (4.0, True)]:
        ours = route(x, w, groups, 1, cf, 0.0, 0.0)
        out = top1gating(x @ w.t(), cf, 0, use_rts=False, sparse_routes=True)
        kept_ds = out[3].squeeze(0) >= 0  # experts of evicted routes are -1
        assert torch.equal(kept_ds, ours.kept.squeeze(1)) == same
        assert int(out[1]) == ours.capacity  # the capacity itself agrees
        assert torch.isclose(out[0], torch.tensor(ours.stats["aux_loss"]))  # Switch Eq. 4


def test_megatron_moe_top2_with_both_losses_equals_golden_and_native(pools):
    """Top-2 with the balancing loss and the z-loss (which DeepSpeed cannot compare): Megatron's
    all-to-alls are ours plus one of the E C gate probabilities each way per MoE layer per
    micro-batch (its experts scale their outputs on the expert's rank)."""
    cls = get_scheme("baseline.megatron.moe")
    if cls.unavailable():
        pytest.skip(cls.unavailable())
    ov = {"moe_top_k": 2, "moe_z_loss_coef": 1e-3}
    ours, _ = run_on_pool(pools, case_for("expert.alltoall", **ov))
    case = case_for("baseline.megatron.moe", **ov)
    theirs, per_rank = run_on_pool(pools, case)
    assert ours.equivalent and theirs.equivalent
    for a, b in zip(ours.losses, theirs.losses):
        assert abs(a - b) <= LOSS_AGREE * abs(a), (ours.losses, theirs.losses)
    assert_ours_plus_probabilities(case, per_rank)


def assert_ours_plus_probabilities(case, per_rank) -> None:
    """Megatron's MoE traffic: ``expert.alltoall``'s closed form plus one all-to-all of the
    E C fp32 gate probabilities each way per MoE layer per micro-batch."""
    pred = get_scheme("expert.alltoall").predict(case)
    f = pred.figures
    per = f["moe_layers"] * case.layout.num_microbatches
    probs = f["a2a_message_bytes"] // case.model.hidden_size  # E C fp32 probabilities
    for r in per_rank:
        assert r.calls_by_axis_per_step[-1]["ep"] == pred.calls[r.rank]["ep"] + 2 * per
        assert r.wire_by_axis_per_step[-1]["ep"] == pred.wire_bytes[r.rank]["ep"] + \
            2 * per * probs / 2  # (ep - 1)/ep of each, ep = 2
        assert r.wire_by_axis_per_step[-1]["dp"] == pred.wire_bytes[r.rank]["dp"]


LLAMA_BLOCKS = {"rope_theta": 10000, "position_embeddings": "false", "norm": "rmsnorm",
                "num_kv_heads": 2}


def test_megatron_gptmodel_moe_equals_golden_with_megatron_moe_traffic(pools):
    """Megatron-Core's whole GPTModel (local spec: its attention with RoPE and GQA, RMSNorm,
    embedding, cross-entropy) with MoELayer in every layer -- SwiGLU experts without biases,
    as Mixtral's -- top-2 with both losses, ep = 2:
    equal to the golden run; its all-to-alls are MoELayer's (ours plus the probabilities)
    and its gradient all-reduce ours (issue 21)."""
    cls = get_scheme("baseline.megatron.gpt-moe")
    if cls.unavailable():
        pytest.skip(cls.unavailable())
    # Mixtral's experts too: SwiGLU ([gate; up] in Megatron's linear_fc1) without biases
    case = case_for(cls.name, moe_top_k=2, moe_z_loss_coef=1e-3, mlp="swiglu", bias="false",
                    **LLAMA_BLOCKS)
    theirs, per_rank = run_on_pool(pools, case)  # isolated: fresh ranks
    assert theirs.equivalent, theirs
    assert_ours_plus_probabilities(case, per_rank)
    with pytest.raises(ConfigError, match="gpt-moe-bias"):  # the bias never moves in
        case_for(cls.name, moe_router="sigmoid", moe_bias_update_rate=1e-3)  # capacity mode
    with pytest.raises(ConfigError, match="bias is not supported in the shared experts"):
        case_for(cls.name, moe_shared_expert_size=16)




def test_megatron_gptmodel_moe_shared_expert_under_tp_x_ep_equals_golden(pools):
    """Issue 21: DeepSeek's shared expert (Megatron-Core's SharedExpertMLP, split over tp)
    beside fine-grained routed experts split over expert-tp = tp (Megatron's default), with
    sequence parallelism (its MoELayer's rule for tp > 1), tp = ep = dp = 2, the sigmoid
    router's group-limited routing and its balancing loss (each token's unbiased top-k of all
    experts counted, DeepSeek-V3 Eq. 18, by Megatron-Core and the reference): equal to the
    golden run. Each rank routes its s/tp tokens, so its all-to-alls are 1/tp of the tp = 1
    ones; the expert-tp group all-gathers the tokens and probabilities after the ep
    all-to-all and reduce-scatters the outputs before it returns (each way per MoE layer
    and micro-batch: ``etp_wire``)."""
    cls = get_scheme("baseline.megatron.gpt-moe")
    if cls.unavailable():
        pytest.skip(cls.unavailable())
    case = case_for(cls.name, tp=2, sp="true", **DEEPSEEK_TINY)
    theirs, per_rank = run_on_pool(pools, case)  # isolated: fresh ranks
    assert theirs.equivalent, theirs
    pred = get_scheme("expert.alltoall").predict(case)  # its closed form, tp = 1
    f, t = pred.figures, case.layout.tp
    per = f["moe_layers"] * case.layout.num_microbatches
    tokens, probs = f["a2a_message_bytes"], f["a2a_message_bytes"] // case.model.hidden_size
    for r in per_rank:
        wire, calls = r.wire_by_axis_per_step[-1], r.calls_by_axis_per_step[-1]
        assert wire["ep"] == (pred.wire_bytes[r.rank]["ep"] + per * probs) / t  # ep = 2
        assert calls["ep"] == pred.calls[r.rank]["ep"] + 2 * per
        assert wire["etp"] == etp_wire(per, t, tokens, probs) and calls["etp"] == 6 * per
    with pytest.raises(ConfigError, match="requires sequence parallelism"):
        case_for(cls.name, tp=2, **DEEPSEEK_TINY)


def test_megatron_expert_bias_counts_the_padded_capacity_map():
    """The finding of ``baseline.megatron.gpt-moe-bias``: in capacity mode with padding
    Megatron-Core counts every expert at its capacity for the balancing bias, so the bias
    never moves (its reproducer, run here, fails once Megatron counts the routed tokens)."""
    import runpy
    from pathlib import Path
    cls = get_scheme("baseline.megatron.gpt-moe-bias")
    if cls.unavailable():
        pytest.skip(cls.unavailable())
    script = "scripts/megatron_expert_bias_capacity_repro.py"
    assert script in cls.known_finding
    repro = runpy.run_path(str(Path(__file__).parents[2] / script))
    assert repro["main"]() == 0  # reproduced: uniform counts with padding, not without


def etp_wire(per: int, t: int, tokens: float, probs: float) -> float:
    """Wire bytes per rank and step on the expert-tp group (size t): per MoE layer and
    micro-batch an all-gather of the t ranks' E C/t x h tokens and E C/t probabilities
    forward (their reduce-scatters backward) and a reduce-scatter of the outputs forward
    (an all-gather backward); each moves (t-1)/t of t E C/t elements per rank."""
    return 2 * per * (t - 1) * (2 * tokens + probs) / t


def test_megatron_moe_rejects_what_it_cannot_compare():
    missing = get_scheme("baseline.megatron.moe").unavailable()
    if missing:
        pytest.skip(missing)
    for ov, rule in [({"moe_capacity_factor": 1.0}, "would drop tokens in another order"),
                     ({"ep": 1}, "ep=1")]:
        with pytest.raises(ConfigError, match=rule):
            case_for("baseline.megatron.moe", **ov)
