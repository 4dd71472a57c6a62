"""The planner's memory check is ``estimate``'s (issue 22, sec. 2): the figure that prunes a
layout is the analytic model's count -- the chosen accounting, eager or flash attention, MoE
layers as MoE -- not a second count; and a layout over memory under the chosen accounting is
never proposed."""
from __future__ import annotations

from dataclasses import replace

import pytest

from parbench.analytic import Counting, estimate, shape_from
from parbench.config import model_preset
from parbench.plan import Space, layouts, plan
from parbench.timemodel import Training, load_profile, predict_step

#: a small MoE model: every layer routed over 4 experts, two per token
MOE = dict(num_experts=4, moe_top_k=2)


def _estimate_bytes(shape, trn: Training) -> float:
    """``estimate``'s own blocks: the most loaded stage's model states, the first rank's
    activations of the micro-batches in flight (Korthikanti et al. Sec. 4.2.3), and with
    one pipeline stage the logits that stage also holds."""
    lay, opt = trn.layout, trn.options
    counting = Counting(bytes_per_element=2, accounting=trn.accounting,
                        attention=trn.attention)
    mem = estimate(shape, lay, opt, counting).memory
    acts = mem.activations
    logits = acts.last_stage_logits if lay.pp == 1 else 0.0
    return mem.model_states.selected.total + acts.first_stage_korthikanti + logits


@pytest.mark.parametrize("preset, extra, fields", [
    ("gpt3-175b", {}, dict(tp=8, pp=16, dp=8, num_microbatches=64, sp=True,
                           recompute="selective", accounting="megatron", attention="flash")),
    ("gpt3-175b", {}, dict(tp=8, pp=8, dp=16, num_microbatches=32, sp=True, zero_stage=1,
                           accounting="mixed_adam", attention="eager")),
    ("llama2-70b", {}, dict(tp=8, pp=1, dp=4, num_microbatches=4, sp=True, zero_stage=3,
                            accounting="deepspeed18", attention="flash")),
    ("small", MOE, dict(tp=2, pp=1, dp=4, ep=4, num_microbatches=2, sp=True,
                        zero_stage=1, accounting="megatron", attention="eager")),
    ("small", MOE, dict(tp=1, pp=1, dp=8, ep=2, micro_batch_size=2, num_microbatches=2,
                        attention="flash")),
])
def test_the_time_models_memory_is_estimates(preset, extra, fields):
    """``predict_step``'s memory per rank (what ``plan`` prunes by, and ``estimate
    device=`` prints) equals the analytic estimate's for the same layout and counting: on
    these layouts the first pipeline rank is the most loaded, so estimate's first-stage
    figure is the peak. MoE layers are counted with their routed terms."""
    shape = shape_from(model_preset(preset), **extra)
    trn = Training.of(**fields)
    st = predict_step(shape, trn, load_profile("a100-80gb"))
    assert st.memory_per_rank_bytes == pytest.approx(_estimate_bytes(shape, trn), rel=1e-12)
    md = st.breakdown["memory"]
    if shape.moe:  # the routed terms are in: an MoE layer is not priced as a dense one
        assert md["activation_per_moe_layer"] != md["activation_per_layer"]
        assert md["activations"] == pytest.approx(
            shape.l * md["in_flight_microbatches"] * md["activation_per_moe_layer"])


def test_attention_and_accounting_change_the_figure():
    """Flash attention keeps no s x s scores, Megatron's 18 bytes per parameter exceed
    mixed-precision Adam's 16: both reach the time model's memory."""
    shape = shape_from(model_preset("gpt3-175b"))
    prof = load_profile("a100-80gb")
    base = dict(tp=8, pp=16, dp=8, num_microbatches=64, sp=True)
    mem = {k: predict_step(shape, Training.of(**base, **kw), prof).memory_per_rank_bytes
           for k, kw in {"eager": {}, "flash": {"attention": "flash"},
                         "megatron": {"accounting": "megatron"}}.items()}
    assert mem["flash"] < mem["eager"] < mem["megatron"]


def test_a_layout_over_memory_under_the_chosen_accounting_is_not_proposed():
    """On a device whose memory lies between a layout's mixed-precision Adam figure and its
    Megatron (18 bytes per parameter) figure, the planner proposes it under the first
    accounting and not under the second; every proposed layout fits by estimate's count."""
    shape = shape_from(model_preset("small"))
    space = Space(micro_batch_sizes=(1,), zero_stages=(0,), recomputes=("none",),
                  schedules=("1f1b",))
    cands = list(layouts(shape, 8, 16, space))
    prof = load_profile("a100-80gb")
    pick = cands[0]
    mixed = _estimate_bytes(shape, replace(pick, accounting="mixed_adam"))
    megatron = _estimate_bytes(shape, replace(pick, accounting="megatron"))
    assert mixed < megatron
    small_dev = replace(prof, memory_bytes=(mixed + megatron) / 2)
    proposed = {}
    for acc in ("mixed_adam", "megatron"):
        res = plan(shape, 8, small_dev, 16, space, keep=len(cands),
                   base=Training(accounting=acc))
        proposed[acc] = [trn.layout for trn, _ in res.ranked]
        for trn, st in res.ranked:
            assert trn.accounting == acc
            assert _estimate_bytes(shape, trn) == pytest.approx(st.memory_per_rank_bytes)
            assert st.memory_per_rank_bytes <= small_dev.memory_bytes
    assert pick.layout in proposed["mixed_adam"]
    assert pick.layout not in proposed["megatron"]
