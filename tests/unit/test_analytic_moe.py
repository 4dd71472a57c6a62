"""The analytic model of MoE models: MoE layers every ``moe_every`` layers, experts split over
ep x etp and replicated over edp = tp*cp*dp/(etp*ep), capacity C = ceil(cf k T / E).

Every expected figure is computed by hand in the test (the arithmetic is in the comments),
not by the functions under test.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import replace

import pytest
import torch

from parbench.analytic import Counting, Shape, estimate
from parbench.analytic import pipeline as closed_pipeline
from parbench.analytic.activations import moe_layer_activation_bytes
from parbench.analytic.flops import shape_forward_flops, shape_training_flops
from parbench.analytic.params import (active_params, expert_layout, layer_split, param_counts,
                                      stage_layer_indices, total_params)
from parbench.analytic.shape import expert_capacity, moe_layer_count, shape_from
from parbench.cli import main
from parbench.config import ModelConfig
from parbench.layout import Layout
from parbench.options import Options
from parbench.model import build_stage

# h = 8, f = 32, V = 16, s = 4, E = 4, two layers, an MoE layer every other layer:
# layer 0 is MoE, layer 1 dense.
SMALL = dict(vocab_size=16, hidden_size=8, num_layers=2, num_heads=2, seq_length=4,
             ffn_hidden_size=32, num_experts=4, moe_top_k=1, moe_every=2)
# By hand:
#   LN1 + LN2 4h = 32; QKV 3h^2 + 3h = 216; proj h^2 + h = 72     -> attention block 320
#   MLP 2hf + f + h = 512 + 32 + 8 = 552; router h E = 32
#   embedding V h + s h = 128 + 32 = 160; head 2h + V h = 16 + 128 = 144
ATTN, MLP, ROUTER, EMB, HEAD = 320, 552, 32, 160, 144


def small(**kw) -> Shape:
    return Shape(**(SMALL | kw))


def test_moe_layers_follow_moe_every():
    assert [small().is_moe_layer(i) for i in range(2)] == [True, False]
    five = small(num_layers=5)
    assert five.num_moe_layers == 3  # layers 0, 2, 4
    assert five.num_moe_layers == moe_layer_count(five, range(5))
    assert small(num_experts=0).num_moe_layers == 0
    assert small(moe_every=1).num_moe_layers == 2


def test_whole_model_counts_by_hand():
    # layer 0: 320 + 32 + 4 * 552 = 2560; layer 1: 320 + 552 = 872
    assert total_params(small()) == EMB + 2560 + 872 + HEAD == 3736
    # top-1: the MoE layer passes a token through 1 of its 4 experts: 3 x 552 fewer
    assert active_params(small()) == 3736 - 3 * MLP == 2080
    assert active_params(small(moe_top_k=2)) == 3736 - 2 * MLP


def test_per_rank_counts_by_hand():
    # ep = 2, tp = 1: 2 experts per rank on the MoE layer, the router is dense
    assert layer_split(small(), 1, 2, moe_layer=True) == {"dense": ATTN + ROUTER,
                                                          "expert": 2 * MLP}
    assert layer_split(small(), 1, 2, moe_layer=False) == {"dense": ATTN + MLP, "expert": 0}
    (stage,) = param_counts(small(), ep=2)["stages"]
    assert stage["dense"] == EMB + (ATTN + ROUTER) + (ATTN + MLP) + HEAD == 1528
    assert stage["expert"] == 2 * MLP == 1104
    assert stage["total"] == 2632 and stage["moe_layers"] == 1


def test_expert_tensor_parallel_split_by_hand():
    # tp = 2, etp = 1: attention and dense MLP split over tp, each expert whole;
    # QKV (192 + 24)/2 = 108, proj 64/2 + 8 = 40, LNs 32 -> 180; router 32 replicated
    moe = layer_split(small(), 2, 2, etp=1, moe_layer=True)
    assert moe == {"dense": 180 + 32, "expert": 2 * 552}
    # etp = 2: each expert (2hf + f)/2 + h = 272 + 8 = 280
    assert layer_split(small(), 2, 2, etp=2, moe_layer=True)["expert"] == 2 * 280
    # etp = 0 means etp = tp
    assert layer_split(small(), 2, 2, etp=0, moe_layer=True)["expert"] == 2 * 280


def test_expert_data_parallel_group():
    shp = small()
    assert expert_layout(shp, tp=1, cp=1, dp=4, ep=2) == {
        "tp": 1, "etp": 1, "ep": 2, "dense_dp": 4, "edp": 2}
    # tp = 2 (etp = tp), cp = 2, dp = 2: 8 ranks = 2 x 2 x edp, edp = 2
    assert expert_layout(shp, tp=2, cp=2, dp=2, ep=2)["edp"] == 2
    # etp = 1 instead: 8 = 1 x 2 x 4
    assert expert_layout(shp, tp=2, cp=2, dp=2, ep=2, etp=1)["edp"] == 4


def test_interleaved_stages_hold_the_megatron_layers():
    # 8 layers, pp = 2, vpp = 2: chunks of 2; rank 0 holds virtual stages 0 and 2
    assert stage_layer_indices(8, 2, 2) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    shp = small(num_layers=8, moe_every=3)  # MoE layers 0, 3, 6
    rows = param_counts(shp, pp=2, vpp=2, ep=2)["stages"]
    assert [r["moe_layers"] for r in rows] == [1, 2]
    assert [r["expert"] for r in rows] == [2 * MLP, 2 * 2 * MLP]


def test_capacity_by_hand():
    assert expert_capacity(8, 4, 1, 1.0) == 2  # ceil(8 / 4)
    assert expert_capacity(8, 4, 2, 1.5) == 6  # ceil(1.5 * 2 * 8 / 4)
    assert expert_capacity(8, 4, 2, 0) is None
    assert expert_capacity(40, 4, 1, 1.1) == 11  # 1.1 * 40 / 4 = 11 exactly, not 11.000...02


LAYOUT_FIELDS = {f.name for f in dataclasses.fields(Layout)}
FP32 = Counting(bytes_per_element=4)


def _small_estimate(**kw):
    lay = dict(micro_batch_size=2, dp=4, ep=2) | {k: v for k, v in kw.items()
                                                  if k in LAYOUT_FIELDS}
    opts = {"zero_stage": 1} | {k: v for k, v in kw.items() if k not in LAYOUT_FIELDS}
    return estimate(small(), Layout(**lay), Options().with_values(**opts), FP32)


def test_estimate_model_states_per_group_by_hand():
    ms = _small_estimate().memory.model_states
    # fp32_adamw (4, 4, 8 bytes), ZeRO-1: optimizer states partitioned over each group.
    # dense 1528 over dp*cp = 4: 4*1528 + 4*1528 + 8*382 = 15280
    # expert 1104 over edp = 4/2 = 2: 4*1104 + 4*1104 + 8*552 = 13248
    dense, expert = ms.groups["dense"], ms.groups["expert"]
    assert (dense.group_size, expert.group_size) == (4, 2)
    assert dense.group.startswith("dp x cp") and expert.group.startswith("edp")
    assert (dense.per_rank_params, expert.per_rank_params) == (1528, 1104)
    assert dense.padded.as_dict() == {"param": 6112, "grad": 6112, "optim": 3056,
                                      "total": 15280}
    assert expert.padded.as_dict() == {"param": 4416, "grad": 4416, "optim": 4416,
                                       "total": 13248}
    assert ms.selected.padded.total == 15280 + 13248
    assert ms.per_rank_params == 2632
    # ZeRO-3 partitions the parameters too: dense ceil(1528/4) = 382, expert 552 per rank
    ms3 = _small_estimate(zero_stage=3).memory.model_states
    assert ms3.selected.padded.total == 16 * 382 + 16 * 552


def test_estimate_all_to_all_bytes_by_hand():
    out = _small_estimate()
    ep = out.communication.per_axis["ep"]
    # T = b s = 8 tokens, top-1, cf 1: C = 2, E C = 8 rows of h = 8 fp32: 256 bytes per a2a;
    # 4 a2as (2 forward, 2 backward) on the one MoE layer of the rank, one micro-batch;
    # ep = 2 sends half of each: 128 bytes
    assert ep == {"count": 4, "message_bytes": 4 * 256, "wire_bytes": 4 * 128}
    info = out.communication.expert
    assert (info.tokens_per_rank, info.capacity_per_expert, info.moe_layers_on_rank) \
        == (8, 2, 1)
    # full recomputation: 6 a2as; 3 micro-batches: x3
    ep = _small_estimate(recompute="full", num_microbatches=3).communication.per_axis["ep"]
    assert ep["count"] == 18 and ep["message_bytes"] == 18 * 256
    # top-2, cf 1.5: C = 6, 24 rows = 768 bytes; no capacity: k T = 16 rows = 512 bytes
    top2 = small(moe_top_k=2)
    lay = Layout(micro_batch_size=2, dp=4, ep=2)
    got = estimate(replace(top2, moe_capacity_factor=1.5), lay, counting=FP32)
    assert got.communication.transfers[0].message_bytes == 768
    assert got.inputs.moe_capacity_factor == 1.5
    got = estimate(replace(top2, moe_capacity_factor=0), lay, counting=FP32)
    assert got.communication.per_axis["ep"]["message_bytes"] == 4 * 512
    # every layer MoE (moe_every = 1): two MoE layers, twice the a2as
    every = estimate(small(moe_every=1), lay, counting=FP32)
    assert every.communication.per_axis["ep"]["count"] == 8


def test_estimate_gradient_traffic_per_group_by_hand():
    axes = _small_estimate().communication.per_axis
    # ZeRO-1: reduce-scatter + all-gather of each group's flat buffer (fp32)
    # dense: 1528 params = 6112 bytes over 4 ranks, 3/4 on the wire, twice
    assert axes["dp"] == {"count": 2, "message_bytes": 2 * 6112, "wire_bytes": 2 * 4584}
    # expert: 1104 params = 4416 bytes over edp = 2, 1/2 on the wire, twice
    assert axes["edp"] == {"count": 2, "message_bytes": 2 * 4416, "wire_bytes": 2 * 2208}
    # edp = 1 (dp = ep = 2): the expert gradients need no reduction
    assert "edp" not in _small_estimate(dp=2).communication.per_axis


def test_estimate_flops_count_moe_layers_only():
    out = estimate(small(), Layout(micro_batch_size=2, dp=4, ep=2))
    B, s, h, f, V, E = 8, 4, 8, 32, 16, 4  # noqa: N806
    moe_layer = B * s * (8 * h * h + 4 * h * f + 2 * h * E) + 4 * B * s * s * h
    dense_layer = B * s * (8 * h * h + 4 * h * f) + 4 * B * s * s * h
    assert out.flops.forward_per_iteration == moe_layer + dense_layer + 2 * B * s * h * V


def test_shape_flops_count_experts_on_moe_layers_only():
    # 4 layers, top-2, b = 2 sequences of s = 4: 8 tokens. Per token and layer:
    #   attention linears 8h^2 = 512; dense MLP 4hf = 1024;
    #   MoE layer: 2 experts 2 * 1024 = 2048 of expert MLP, router 2hE = 64
    # per sequence and layer 4 s^2 h = 512 -> 4 layers x 2 sequences: 4096; logits 2 b s h V
    # = 2048
    b, tokens, h, f, E, k = 2, 8, 8, 32, 4, 2  # noqa: N806
    expert_mlp = 4 * h * f * k  # 2048 per token per MoE layer
    assert (expert_mlp, 2 * h * E) == (2048, 64)
    fixed = 4096 + 2048

    def by_hand(n_moe: int) -> int:
        return tokens * (4 * 512 + n_moe * (2048 + 64) + (4 - n_moe) * 1024) + fixed

    every1 = small(num_layers=4, moe_top_k=2, moe_every=1)
    every2 = small(num_layers=4, moe_top_k=2, moe_every=2)  # MoE layers 0 and 2
    assert by_hand(4) == 90112 and by_hand(2) == 72704
    assert shape_forward_flops(every1, b) == 90112
    assert shape_forward_flops(every2, b) == 72704
    # the expert-MLP FLOPs alone: every other layer is exactly half of every layer
    dense = small(num_layers=4, num_experts=0)
    assert shape_forward_flops(dense, b) == by_hand(0) == 55296
    moe_part = {n: shape_forward_flops(s, b) - shape_forward_flops(dense, b)
                for n, s in ((4, every1), (2, every2))}
    assert moe_part == {4: 4 * tokens * (2048 + 64 - 1024), 2: 2 * tokens * (2048 + 64 - 1024)}
    assert moe_part[2] * 2 == moe_part[4]
    # training: layers and logits 3x; with recomputation the layers 4x, the logits 3x
    assert shape_training_flops(every2, b) == 3 * 72704
    assert shape_training_flops(every2, b, recompute=True) == 4 * (72704 - 2048) + 3 * 2048
    # the estimate reports the same counts
    fl = estimate(every2, Layout(micro_batch_size=2, dp=1)).flops
    assert fl.forward_per_iteration == 72704


def test_pipeline_stages_count_moe_layers_only():
    # 4 layers, an MoE layer every other layer (0 and 2), 2 stages of 2 layers:
    # MoE layer ATTN + ROUTER + 4 MLP = 2560, dense layer ATTN + MLP = 872
    shp = small(num_layers=4)
    assert closed_pipeline.stage_numel(shp, 2, 0) == EMB + 2560 + 872 == 3592
    # the last stage: final LN 2h and its own head V h (a separate stage)
    assert closed_pipeline.stage_numel(shp, 2, 1) == 2560 + 872 + 144 == 3576
    # 4 stages: stage 1 holds the dense layer 1 only
    assert closed_pipeline.stage_numel(shp, 4, 1) == 872
    # tensors: an MoE layer 8 + router 1 + 4 experts x 4 = 25, a dense layer 12;
    # stage 0 adds token and position embeddings, the last stage final LN 2 and head 1
    assert closed_pipeline.stage_tensors(shp, 2, 0) == 25 + 12 + 2
    assert closed_pipeline.stage_tensors(shp, 2, 1) == 25 + 12 + 3
    assert closed_pipeline.stage_tensors(shp, 4, 1) == 12


@pytest.mark.parametrize("layers, stages, every", [(4, 2, 2), (4, 4, 2), (6, 3, 3), (4, 2, 1)])
def test_pipeline_stages_are_the_moe_models(layers, stages, every):
    cfg = ModelConfig(num_layers=layers, hidden_size=16, num_heads=2, seq_length=8,
                      vocab_size=64, num_experts=4, moe_every=every)
    shape, ids = shape_from(cfg), range(stages)
    with torch.device("meta"):
        built = [list(build_stage(cfg, 0, s, stages).parameters()) for s in ids]
    assert [sum(t.numel() for t in ps) for ps in built] == \
        [closed_pipeline.stage_numel(shape, stages, s) for s in ids]
    assert [len(ps) for ps in built] == [closed_pipeline.stage_tensors(shape, stages, s)
                                         for s in ids]


def test_moe_layer_activations_by_hand():
    # the estimate's defaults: b = 1, s = 4, h = 8, f = 32, E = 4, top-1, cf 1, 2-byte
    # activations, tp = 1: T = 4 tokens, C = ceil(4 / 4) = 1, E C = 4 rows
    act = estimate(small(), Layout(micro_batch_size=1, dp=2, ep=2)).memory.activations
    s, b, h, a, f, E, e = 4, 1, 8, 2, 32, 4, 2  # noqa: N806
    # Korthikanti Eq. 1 (f = 4h here): sbh (34 + 5as/h) = 32 x 39
    dense = s * b * h * (34 + 5 * a * s // h)
    assert dense == 1248 and act.per_layer_korthikanti == dense
    rows = 4
    router = 2 * 4 * 4 * E  # logits and probabilities, 4 tokens x E, fp32: 128
    dispatch = combine = rows * h * e  # 64 each
    experts = 2 * rows * f * e  # fc1 output and GeLU output on the 4 rows: 512
    replaced = 2 * s * b * f * e  # the dense MLP's: 512
    moe = dense - replaced + router + dispatch + experts + combine
    assert moe == 1504
    terms = act.moe_layer_terms_korthikanti
    assert terms == {"dense_layer": dense, "dense_mlp_replaced": -replaced, "router": router,
                     "dispatch": dispatch, "expert_mlp": experts, "combine": combine,
                     "total": moe}
    assert act.per_moe_layer_korthikanti == moe
    # layer 0 MoE, layer 1 dense; one micro-batch, no pipeline: both layers once
    assert (act.first_stage_moe_layers, act.first_stage_dense_layers) == (1, 1)
    assert act.first_stage_korthikanti == moe + dense
    # every layer MoE: twice the MoE layer
    every = estimate(small(moe_every=1),
                     Layout(micro_batch_size=1, dp=2, ep=2)).memory.activations
    assert every.first_stage_korthikanti == 2 * moe
    # the reference model's count changes by the same terms
    ref = act.per_layer_reference_model
    assert act.per_moe_layer_reference_model == ref + moe - dense
    # full recomputation keeps only the layer input, MoE or not: 2 sbh = 64
    by = act.per_layer_by_recompute
    assert by["full"]["korthikanti_moe"] == by["full"]["korthikanti"] == 2 * s * b * h
    # selective recomputation drops the score matrices, keeps the routed path
    assert by["selective"]["korthikanti_moe"] == by["selective"]["korthikanti"] + moe - dense


def test_moe_layer_activations_capacity_pipeline_and_split():
    # top-2, no capacity limit: k T = 8 of the 4 tokens' copies; tp = etp = 2 with
    # sequence parallelism: T = b s / tp = 2 * 4 / 2 = 4 tokens, 8 rows; the experts' f over 2
    shp = small(num_layers=4, moe_top_k=2, moe_capacity_factor=0)
    lay = Layout(micro_batch_size=2, tp=2, pp=2, dp=2, ep=2, num_microbatches=3)
    sp = Options().with_values(sp=True)
    out = estimate(shp, lay, sp, FP32)
    terms = out.memory.activations.moe_layer_terms_korthikanti
    h, f, E, e = 8, 32, 4, 4  # noqa: N806
    assert terms["router"] == 2 * 4 * 4 * E
    assert terms["dispatch"] == terms["combine"] == 8 * h * e
    assert terms["expert_mlp"] == 2 * 8 * f * e / 2
    assert terms["dense_mlp_replaced"] == -2 * 4 * 2 * f * e / 2  # s b f e / t, twice
    # capacity 1.5: C = ceil(1.5 * 2 * 4 / 4) = 3, E C = 12 padded rows
    cap = estimate(replace_cf(shp, 1.5), lay, sp, FP32)
    assert cap.memory.activations.moe_layer_terms_korthikanti["dispatch"] == \
        12 * h * e
    # pp = 2: the first rank holds layers 0 (MoE) and 1 (dense), 1F1B keeps min(pp, m) = 2
    # micro-batches in flight
    act = out.memory.activations
    assert (act.first_stage_moe_layers, act.first_stage_dense_layers) == (1, 1)
    assert act.first_stage_korthikanti == 2 * (act.per_layer_korthikanti
                                               + act.per_moe_layer_korthikanti)
    # a direct call: the function only adds the routed terms to the dense layer's count
    got = moe_layer_activation_bytes(100.0, s=4, b=1, h=8, f=32, tp=1, tokens=4, rows=4,
                                     num_experts=4, etp=1, bytes_per_element=2)
    assert got["total"] == 100 - 512 + 128 + 64 + 512 + 64


def replace_cf(shape: Shape, cf: float) -> Shape:
    return Shape(**(SMALL | {"num_layers": shape.num_layers, "moe_top_k": shape.moe_top_k,
                             "moe_capacity_factor": cf}))


def test_dense_model_estimate_is_unchanged():
    dense = dict(SMALL, num_experts=0)
    kw = dict(micro_batch_size=2, dp=2, cp=2, tp=2, pp=2)
    rest = (Options().with_values(zero_stage=2), FP32)
    base = estimate(Shape(**{k: v for k, v in dense.items() if k != "moe_every"}),
                    Layout(**kw), *rest)
    # the MoE-only fields mean nothing without experts
    assert estimate(Shape(**dense | {"moe_every": 3, "moe_capacity_factor": 2.0}),
                    Layout(**kw), *rest) == base
    assert estimate(Shape(**dense), Layout(etp=0, **kw), *rest) == base
    assert base.memory.model_states.groups is None
    assert "edp" not in base.communication.per_axis
    assert base.inputs.etp is None and base.parameters.moe_layers is None


# the layout states each rule once (parbench.layout): the expert grid when the layout is built,
# the experts when it meets the model
@pytest.mark.parametrize("kw, message", [
    (dict(ep=3, dp=3), "ep=3 does not divide num_experts=4"),
    (dict(ep=4, dp=2), r"ep=4 does not divide cp\*dp=2"),
    (dict(ep=2, tp=2, etp=2), r"ep=2 does not divide cp\*dp=1"),
    (dict(etp=3), r"etp\*ep=3\*1 does not divide tp\*cp\*dp=1"),
    (dict(etp=3, dp=3), "etp=3 does not divide ffn_hidden_size=32"),
])
def test_bad_expert_layouts_name_field_value_and_rule(kw, message):
    with pytest.raises(ValueError, match=message):
        estimate(small(), Layout(micro_batch_size=1, **kw))


def test_bad_moe_inputs():
    with pytest.raises(ValueError, match="ep=2 needs an MoE model"):
        estimate(small(num_experts=0), Layout(micro_batch_size=1, ep=2, dp=2))
    with pytest.raises(ValueError, match="etp=2 needs num_experts > 0"):
        estimate(small(num_experts=0), Layout(micro_batch_size=1, etp=2, dp=2))
    with pytest.raises(ValueError, match="moe_every=0 must be a positive integer"):
        small(moe_every=0)
    with pytest.raises(ValueError, match="moe_capacity_factor=-1 must be"):
        small(moe_capacity_factor=-1)


def test_shape_from_reads_moe_fields_when_present():
    class Cfg:
        vocab_size, hidden_size, num_layers, num_heads, seq_length = 16, 8, 2, 2, 4
        num_experts = 4

    assert shape_from(Cfg()).moe_every == 1 and shape_from(Cfg()).moe_capacity_factor == 1.0
    Cfg.moe_every, Cfg.moe_capacity_factor = 2, 0.0
    assert (shape_from(Cfg()).moe_every, shape_from(Cfg()).moe_capacity_factor) == (2, 0.0)


UBMESH = ["estimate", "model=ubmesh-moe-2t", "tp=16", "cp=16", "ep=8", "pp=3", "dp=4",
          "sp=true", "recompute=full", "num_microbatches=26", "zero_stage=1"]


def test_cli_ubmesh_moe_reports_expert_states_over_edp(capsys):
    assert main([*UBMESH, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    h, f = 12288, 4 * 12288
    ms = out["memory"]["model_states"]
    expert = ms["groups"]["expert"]
    # edp = tp cp dp / (etp ep) = 16 * 16 * 4 / (16 * 8) = 8
    assert out["inputs"]["edp"] == expert["group_size"] == 8
    assert ms["groups"]["dense"]["group_size"] == 64
    # 16 / 8 = 2 experts per rank, each (2hf + f)/16 + h, on each of a stage's 32 layers
    per_expert = (2 * h * f + f) // 16 + h
    assert expert["per_rank_params"] == 32 * 2 * per_expert
    # mixed_adam (2, 2, 12 bytes), ZeRO-1 over edp = 8
    n = expert["per_rank_params"]
    assert expert["padded"]["total"] == 4 * n + 12 * -(-n // 8)
    axes = out["communication"]["per_axis"]
    # 6 a2as per layer per micro-batch, 32 layers, 26 micro-batches (UB-Mesh Table 1: 4992)
    assert axes["ep"]["count"] == 4992
    assert {"dp", "edp"} <= set(axes)


def test_cli_moe_every_and_errors(capsys):
    assert main([*UBMESH, "moe_every=2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["parameters"]["moe_layers"] == 48
    assert [r["moe_layers"] for r in out["parameters"]["stages"]] == [16, 16, 16]
    assert out["communication"]["per_axis"]["ep"]["count"] == 6 * 16 * 26
    assert main(["estimate", "model=ubmesh-moe-2t", "tp=16", "cp=16", "dp=4", "ep=3"]) == 2
    assert "ep=3 does not divide cp*dp=64" in capsys.readouterr().err
    assert main(["estimate", "model=ubmesh-moe-2t", "tp=16", "dp=4", "ep=8"]) == 2
    assert "ep=8 does not divide cp*dp=4" in capsys.readouterr().err
    assert main(["estimate", "model=gpt3-175b", "ep=2", "dp=2"]) == 2
    assert "ep=2 needs an MoE model" in capsys.readouterr().err


def test_cli_prints_expert_states(capsys, monkeypatch):
    # a wide console: the breakdown's keys are read whole, not wrapped at 80 columns (a
    # pytest-xdist worker has no terminal to take the width from)
    monkeypatch.setenv("COLUMNS", "200")
    assert main([*UBMESH, "verbose=true"]) == 0  # the full breakdown (default: a summary)
    text = capsys.readouterr().out
    assert "model_states.groups.expert.padded.total" in text
    assert "edp = tp*cp*dp/(etp*ep)" in text


@pytest.mark.parametrize("preset, total, active", [
    # Mixtral 8x7B: the released checkpoint's count (46.7B) and two experts of eight
    # active per token (12.9B); written from Jiang et al. 2024, Table 1's shape
    ("mixtral-8x7b", 46_702_792_704, 12_879_925_248),
])
def test_mixtral_presets_have_the_published_parameter_counts(preset, total, active):
    from parbench.config import model_preset
    from parbench.analytic.shape import shape_from
    shape = shape_from(model_preset(preset))
    assert (total_params(shape), active_params(shape)) == (total, active)


def test_mixtral_8x22b_is_mistrals_141b_with_39b_active():
    from parbench.config import model_preset
    from parbench.analytic.shape import shape_from
    shape = shape_from(model_preset("mixtral-8x22b"))
    assert round(total_params(shape) / 1e9) == 141
    assert round(active_params(shape) / 1e9) == 39


# ---- fine-grained and shared experts, dense first layers (DeepSeekMoE; issue 21) ----------

def test_deepseek_moe_16b_has_the_published_parameter_counts():
    """Dai et al. 2024: 16.4B parameters, 2.8B activated; the counts below are the released
    config's shapes summed by hand in the test's own arithmetic (per MoE layer: attention
    4h^2, two RMSNorms, 64 routed SwiGLU experts of 1408, two shared ones, the router)."""
    from parbench.analytic.shape import shape_from
    from parbench.config import model_preset
    shape = shape_from(model_preset("deepseek-moe-16b"))
    h, V = 2048, 102400
    attn, norms = 4 * h * h, 2 * h
    expert = 3 * h * 1408
    dense_layer = attn + norms + 3 * h * 10944
    moe_layer = attn + norms + 64 * expert + 2 * expert + 64 * h
    ends = 2 * V * h + h
    assert shape.num_moe_layers == 27 and not shape.is_moe_layer(0)
    assert total_params(shape) == dense_layer + 27 * moe_layer + ends == 16_375_728_128
    active = dense_layer + 27 * (moe_layer - 58 * expert) + ends
    assert active_params(shape) == active == 2_828_650_496


def test_shared_and_fine_grained_experts_in_flops_activations_and_time():
    from dataclasses import replace
    from parbench.analytic.activations import moe_layer_activation_bytes
    from parbench.analytic.flops import shape_forward_flops
    from parbench.analytic.shape import shape_from
    from parbench.config import model_preset
    shape = shape_from(model_preset("deepseek-moe-16b"))
    h, b, s = 2048, 1, 4096
    # per token of an MoE layer: 6 h (k f_e + f_shared) + 2 h E over the MLP of width f
    plain = replace(shape, moe_shared_expert_size=0, moe_ffn_hidden_size=0, moe_first_dense=0)
    diff = shape_forward_flops(shape, b) - shape_forward_flops(plain, b)
    moe_gain = 6 * h * (6 * 1408 + 2816) - 6 * h * 6 * 10944
    dense_gain = 6 * h * 10944 - (6 * h * 6 * 10944 + 2 * h * 64)  # layer 0 turned dense
    assert diff == b * s * (27 * moe_gain + dense_gain)
    kw = dict(s=s, b=b, h=h, f=10944, tp=2, tokens=s, rows=6 * s, num_experts=64, etp=1,
              bytes_per_element=2, mlp="swiglu")
    with_shared = moe_layer_activation_bytes(100.0, **kw, expert_f=1408, shared_f=2816)
    assert with_shared["shared_mlp"] == 3 * s * b * 2816 * 2 / 2
    assert with_shared["expert_mlp"] == 3 * 6 * s * 1408 * 2
    assert "shared_mlp" not in moe_layer_activation_bytes(100.0, **kw)
    from parbench.timemodel import PRESETS, Training, predict_step
    trn = Training.of(ep=8, dp=8, micro_batch_size=1, num_microbatches=1)
    prof = PRESETS["h100-80gb"]
    no_shared = replace(shape, moe_shared_expert_size=0)
    assert predict_step(shape, trn, prof).compute_s > predict_step(no_shared, trn, prof).compute_s


def test_megatron_moe_arguments_import_deepseek_moe():
    import shlex
    from parbench.analytic.shape import shape_from
    from parbench.config import ConfigError
    from parbench.imports import from_megatron_args
    args = ("--num-layers 28 --hidden-size 2048 --ffn-hidden-size 10944 "
            "--num-attention-heads 16 --seq-length 4096 --max-position-embeddings 4096 "
            "--vocab-size 102400 --swiglu --normalization RMSNorm --disable-bias-linear "
            "--untie-embeddings-and-output-weights --position-embedding-type rope "
            "--num-experts 64 --moe-router-topk 6 --moe-ffn-hidden-size 1408 "
            "--moe-shared-expert-intermediate-size 2816 --moe-layer-freq '([0]*1+[1]*27)'")
    case = from_megatron_args(shlex.split(args))
    assert total_params(shape_from(case.model)) == 16_375_728_128
    with pytest.raises(ConfigError, match="gives 27 layers, not --num-layers=28"):
        from_megatron_args(shlex.split(args.replace("[1]*27", "[1]*26")))


# ---- multi-head latent attention (DeepSeek-V2 / V3; issue 21) ------------------------------

def test_deepseek_v3_has_the_published_parameter_counts():
    """DeepSeek-V3 report: 671B parameters, 37B activated for each token (both truncated to
    the billion). Summed here from the released shapes in the test's own arithmetic: MLA's
    projections (query latent 1536, K/V latent 512 with a 64-wide rotary key, 128 heads of
    128 + 64 for queries and keys, 128 for values), three dense layers, then 58 MoE layers of
    256 routed SwiGLU experts of 2048, one shared, a router."""
    from parbench.analytic.shape import shape_from
    from parbench.config import model_preset
    shape = shape_from(model_preset("deepseek-v3"))
    h, V, a = 7168, 129280, 128
    mla = (h * 1536 + 1536 + 1536 * a * 192 + h * (512 + 64) + 512 + 512 * a * 256
           + a * 128 * h)
    expert = 3 * h * 2048
    dense = mla + 2 * h + 3 * h * 18432
    moe = mla + 2 * h + 256 * expert + expert + 256 * h
    ends = 2 * V * h + h
    assert total_params(shape) == 3 * dense + 58 * moe + ends == 671_026_404_352
    active = 3 * dense + 58 * (moe - 248 * expert) + ends
    assert active_params(shape) == active == 37_552_282_624
    assert total_params(shape) // 10**9 == 671 and active_params(shape) // 10**9 == 37


def test_mla_flops_kv_cache_and_activations():
    """Per token and MLA layer: twice its projections' weights; per sequence: QK^T over the
    128 x 192 query/key width and AV over 128 x 128 values; the KV cache holds 512 + 64
    elements a token and layer (DeepSeek-V2, Table 1), whole on every tp rank."""
    from dataclasses import replace
    from parbench.analytic.flops import shape_forward_flops
    from parbench.analytic.kv_cache import kv_cache
    from parbench.analytic.activations import layer_activation_bytes
    from parbench.analytic.shape import shape_from
    from parbench.config import model_preset
    v3 = shape_from(model_preset("deepseek-v3"))
    one = replace(v3, num_layers=1, num_experts=0, moe_first_dense=0, vocab_size=1)
    h, a, b, s = 7168, 128, 1, 64
    proj = h * 1536 + 1536 * a * 192 + h * 576 + 512 * a * 256 + a * 128 * h
    mlp = 6 * h * 18432
    want = b * s * (2 * proj + mlp) + 2 * b * s * s * (a * 192 + a * 128) + 2 * b * s * h
    assert shape_forward_flops(one, b, s) == want
    kv = kv_cache(v3, 2, 100, prompt=412, tp=8, pp=1, bytes_per_element=2)
    assert kv.total_bytes == 2 * 2 * 61 * 576 * 512 and kv.per_rank_bytes == kv.total_bytes
    # activations: Q, K at 128 x 192, V and the output at 128 x 128 over t, the latents whole
    t, e = 8, 2
    got = layer_activation_bytes(s, b, h, a, t, False, "none", 18432, bytes_per_element=e,
                                 attention="flash", **one.attention_keywords())
    replicated = s * b * h * (4 * e + 2)
    split = ((a * 192 * 2 + a * 128 * 2) * s * b + 3 * s * b * 18432) * e
    flash = s * b * a * 128 * e + a * s * b * 4
    latent = (2 * 1536 + 2 * 512 + 64) * s * b * e
    assert got == replicated + latent + (split + flash) / t


def test_mla_refuses_context_parallelism_and_imports_from_megatron():
    import shlex
    from parbench.analytic.shape import shape_from
    from parbench.config import ConfigError, model_preset
    from parbench.imports import from_megatron_args
    from parbench.layout import Layout
    v3 = shape_from(model_preset("deepseek-v3"))
    with pytest.raises(ConfigError, match="multi-head latent attention is not modelled under"):
        Layout(cp=2, ep=2).check_model(v3)
    args = ("--num-layers 61 --hidden-size 7168 --ffn-hidden-size 18432 "
            "--num-attention-heads 128 --seq-length 4096 --max-position-embeddings 4096 "
            "--vocab-size 129280 --swiglu --normalization RMSNorm --disable-bias-linear "
            "--untie-embeddings-and-output-weights --position-embedding-type rope "
            "--multi-latent-attention --qk-layernorm --q-lora-rank 1536 --kv-lora-rank 512 "
            "--qk-head-dim 128 --qk-pos-emb-head-dim 64 --v-head-dim 128 --kv-channels 128 "
            "--num-experts 256 --moe-router-topk 8 --moe-ffn-hidden-size 2048 "
            "--moe-shared-expert-intermediate-size 2048 --moe-layer-freq '([0]*3+[1]*58)'")
    case = from_megatron_args(shlex.split(args))
    assert total_params(shape_from(case.model)) == 671_026_404_352


def test_estimate_prints_total_and_active_parameters_of_an_moe_model(capsys):
    """``parbench estimate model=deepseek-v3``: the report's 671B, and 37B activated (the
    report truncates: 37.55B)."""
    import re
    from parbench.cli import main
    assert main(["estimate", "model=deepseek-v3"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    total, active = map(float, re.search(r"\(([\d.,]+) B parameters, ([\d.]+) B active\)",
                                         first).groups())
    assert total == 671.0 and 37.0 <= active < 38.0
