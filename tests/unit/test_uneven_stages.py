"""Uneven pipeline stages (issue 21): Megatron-Core's ``num_layers_in_first_pipeline_stage`` /
``..._last_...`` as ``Layout.first_stage_layers`` / ``last_stage_layers``, in the layout
rules, the analytic model, the time model, the planner and the Megatron argument import.

The expected splits are written from Megatron-Core's ``get_transformer_layer_offset`` (the
first layer of each virtual stage, computed here as that function states it) and from the
Llama 3 paper (126 layers on 16 stages, the first and the last one layer short)."""
from __future__ import annotations

import shlex

import pytest

from parbench.analytic.params import stage_params, total_params
from parbench.analytic.shape import Shape
from parbench.analytic.stages import stage_layer_indices
from parbench.config import ConfigError, model_preset
from parbench.imports import from_megatron_args
from parbench.layout import Layout, pipeline_chunks
from parbench.plan import Space, _lighter_ends, layouts
from parbench.timemodel import Link, Profile, Training, predict_step


def megatron_offset(num_layers, pp, vpp, first, last, rank, chunk):
    """The first layer of chunk ``chunk`` of pipeline rank ``rank``, as Megatron-Core's
    ``get_transformer_layer_offset`` states it for uneven stages (0 = not set)."""
    middle_stages = pp - bool(first) - bool(last)
    middle_layers = num_layers - first - last
    middle_rank = rank - 1 if first else rank
    f_c, l_c, m_c = first // vpp, last // vpp, middle_layers // vpp
    if rank == 0:
        return chunk * (f_c + m_c + l_c)
    return chunk * (f_c + m_c + l_c) + f_c + middle_rank * (m_c // middle_stages)


@pytest.mark.parametrize("L, pp, vpp, first, last", [
    (126, 16, 1, 7, 7), (10, 3, 2, 2, 4), (12, 4, 1, 3, 0), (12, 4, 1, 0, 6),
    (20, 4, 2, 2, 2), (16, 4, 1, 4, 4)])
def test_each_chunk_starts_where_megatron_core_places_it(L, pp, vpp, first, last):
    per_rank = stage_layer_indices(L, pp, vpp, first=first, last=last)
    lay = Layout(pp=pp, vpp=vpp, first_stage_layers=first, last_stage_layers=last)
    chunks = lay.chunk_layers(L)
    assert sorted(i for ix in per_rank for i in ix) == list(range(L))
    for r in range(pp):
        n = chunks[r]  # every chunk of a rank holds the same number of layers
        starts = per_rank[r][::n]
        assert starts == [megatron_offset(L, pp, vpp, first, last, r, c) for c in range(vpp)]
    assert lay.stage_layers(L) == [len(ix) for ix in per_rank]
    if first:
        assert len(per_rank[0]) == first
    if last:
        assert len(per_rank[-1]) == last


def test_llama3_405b_split_and_an_even_split_unchanged():
    assert Layout(pp=16, first_stage_layers=7, last_stage_layers=7).stage_layers(126) == \
        [7] + [8] * 14 + [7]
    assert pipeline_chunks(8, 2, 2) == [2, 2, 2, 2]
    assert stage_layer_indices(8, 2, 2) == [[0, 1, 4, 5], [2, 3, 6, 7]]


@pytest.mark.parametrize("fields, L, msg", [
    (dict(pp=16, first_stage_layers=7), 126, "do not split evenly over the 15 other"),
    (dict(pp=2, first_stage_layers=4, last_stage_layers=4), 10,
     "leave 2 layers of num_layers=10 for 0 other"),
    (dict(pp=3, first_stage_layers=6, last_stage_layers=6), 10, "leave -2 layers"),
    (dict(pp=4, vpp=2, first_stage_layers=2), 12, "do not split evenly over the 3 other "
     "pipeline ranks x vpp=2"),
    (dict(pp=5), 12, r"pp\*vpp=5 does not divide num_layers=12"),
])
def test_a_split_megatron_refuses_is_refused_naming_the_rule(fields, L, msg):
    with pytest.raises(ConfigError, match=msg):
        Layout(**fields).chunk_layers(L)
    shape = Shape(vocab_size=64, hidden_size=64, num_layers=L, num_heads=4, seq_length=32)
    assert not Layout(**fields).fits_model(shape)


@pytest.mark.parametrize("fields, msg", [
    (dict(pp=1, first_stage_layers=3), "first_stage_layers=3 needs pp > 1"),
    (dict(pp=4, vpp=2, last_stage_layers=3), "last_stage_layers=3 is not a multiple of vpp=2"),
    (dict(pp=4, first_stage_layers=-1), "first_stage_layers=-1 must be >= 0"),
])
def test_a_bad_uneven_layout_fails_where_it_is_built(fields, msg):
    with pytest.raises(ConfigError, match=msg):
        Layout(**fields)


SMALL = Shape(vocab_size=64, hidden_size=256, num_layers=14, num_heads=4, seq_length=128,
              position_embeddings=False)


def test_the_end_ranks_hold_their_own_layers_and_every_parameter_is_somewhere():
    rows = stage_params(SMALL, pp=4, first=3, last=3)
    assert [r["layers"] for r in rows] == [3, 4, 4, 3]
    assert sum(r["total"] for r in rows) == total_params(SMALL)
    assert rows[1]["transformer"] == rows[0]["transformer"] * 4 // 3


def _flat() -> Profile:
    """A device where only the layers' arithmetic costs time (no links, no overheads)."""
    return Profile(name="flat", device="cuda", calibrated=True, memory_bytes=80e9,
                   matmul_flops={"bf16": 100e12, "fp32": 25e12}, mem_bandwidth=1e30,
                   op_overhead_s=0.0, bwd_op_overhead_s=0.0, backward_call_s=0.0,
                   optimizer={"per_tensor_s": 0.0, "bytes_per_element": 32.0},
                   ranks_per_node=8, links={"intra": Link(1e30, 0.0)}, overlap=1.0)


def test_the_pipeline_runs_at_the_pace_of_its_heaviest_stage():
    """1F1B over stages of T_i per micro-batch takes sum_i T_i + (m - 1) max_i T_i (the first
    micro-batch crosses every stage, the others follow at the slowest stage's pace). Layers
    [3, 4, 4, 3]: 14 units + (m - 1) x 4, the unit priced on one rank."""
    m, prof = 8, _flat()
    one = predict_step(SMALL, Training.of(micro_batch_size=1, num_microbatches=m), prof)
    unit = one.breakdown["pipeline_s"] / (14 * m)
    lay = dict(pp=4, micro_batch_size=1, num_microbatches=m)
    uneven = predict_step(SMALL, Training.of(first_stage_layers=3, last_stage_layers=3, **lay),
                          prof)
    assert uneven.breakdown["pipeline_s"] == pytest.approx((14 + (m - 1) * 4) * unit, rel=0.05)
    # the same split written as ends equal to the middle is the even split, to the bit
    even16 = replace_layers(SMALL, 16)
    a = predict_step(even16, Training.of(**lay), prof)
    b = predict_step(even16, Training.of(first_stage_layers=4, last_stage_layers=4, **lay),
                     prof)
    assert a.step_s == b.step_s and a.memory_per_rank_bytes == b.memory_per_rank_bytes


def replace_layers(shape: Shape, n: int) -> Shape:
    from dataclasses import replace
    return replace(shape, num_layers=n)


def test_a_v_or_two_pipe_schedule_refuses_uneven_ends():
    trn = Training.of(pp=4, vpp=2, schedule="zbv", micro_batch_size=1, num_microbatches=8,
                      first_stage_layers=2, last_stage_layers=2)
    with pytest.raises(ValueError, match="need a linear or looped"):
        predict_step(replace_layers(SMALL, 16), trn, _flat())


def test_the_planner_searches_lighter_ends_where_pp_does_not_divide_the_layers():
    assert _lighter_ends(126, 16) == (7, 7)
    assert _lighter_ends(96, 16) == (0, 0)  # divides: the even split
    assert _lighter_ends(14, 4) == (3, 3)
    assert _lighter_ends(10, 2) == (0, 0)   # two ranks: no middle to take more
    shape = model_preset("llama3-405b")
    from parbench.analytic.shape import shape_from
    shp = shape_from(shape)
    seen = [t.layout for t in layouts(shp, 1024, 1024, Space(max_cp=1, zero_stages=(1,),
                                                               recomputes=("none",)))]
    uneven = [lay for lay in seen if lay.uneven]
    assert uneven and all(lay.fits_model(shp, sp=lay.tp > 1) for lay in seen)
    assert {lay.pp for lay in uneven} == {pp for pp in (4, 8, 16, 32, 64, 128, 256)
                                         if 126 % pp and _lighter_ends(126, pp) != (0, 0)}
    assert all(lay.schedule in ("1f1b", "gpipe", "zb-h1", "zb-h2", "interleaved")
               for lay in uneven)


LLAMA3_405B = """
--num-layers 126 --hidden-size 16384 --ffn-hidden-size 53248 --num-attention-heads 128
--group-query-attention --num-query-groups 8 --kv-channels 128 --seq-length 8192
--max-position-embeddings 8192 --position-embedding-type rope --rotary-base 500000
--normalization RMSNorm --swiglu --disable-bias-linear --untie-embeddings-and-output-weights
--vocab-size 128256 --tensor-model-parallel-size 8 --pipeline-model-parallel-size 16
--decoder-first-pipeline-num-layers 7 --decoder-last-pipeline-num-layers 7
--sequence-parallel --micro-batch-size 1 --global-batch-size 2048 --bf16
"""


def test_megatron_uneven_pipeline_arguments_import():
    case = from_megatron_args(shlex.split(LLAMA3_405B), world_size=16384)
    lay = case.layout
    assert (lay.tp, lay.pp, lay.dp, lay.num_microbatches) == (8, 16, 128, 16)
    assert lay.stage_layers(case.model.num_layers) == [7] + [8] * 14 + [7]
    with pytest.raises(ConfigError, match="give --num-virtual-stages-per-pipeline-rank"):
        from_megatron_args(shlex.split(LLAMA3_405B)
                           + ["--num-layers-per-virtual-pipeline-stage", "1"], 16384)
    with pytest.raises(ConfigError, match="do not split evenly"):
        from_megatron_args(shlex.split(LLAMA3_405B.replace("last-pipeline-num-layers 7",
                                                           "last-pipeline-num-layers 6")),
                           16384).layout.check_model(case.model)


@pytest.mark.parametrize("fields, msg", [
    ("scheme=pipeline.zbv pp=4 vpp=2 num_layers=16 first_stage_layers=2 last_stage_layers=2",
     "pipeline.zbv does not run uneven end ranks"),
    ("scheme=pipeline.pipedream pp=2 num_layers=5 first_stage_layers=2",
     "pipeline.pipedream does not run uneven end ranks"),
    ("scheme=hybrid pp=2 num_layers=6 first_stage_layers=2",
     "scheme hybrid splits the layers evenly"),
    ("scheme=baseline.torch.pipelining.1f1b pp=2 num_layers=5 first_stage_layers=2",
     "splits the layers evenly over its stages"),
    ("scheme=pipeline.1f1b pp=4 num_layers=10 first_stage_layers=3 last_stage_layers=2",
     "the 5 other layers of num_layers=10 do not split evenly"),
])
def test_schemes_that_cannot_run_uneven_ends_refuse_before_spawning(fields, msg):
    from parbench.config import CaseConfig, validate_case
    from parbench.overrides import apply_overrides
    from parbench.registry import get_scheme
    case = apply_overrides(CaseConfig(), dict(kv.split("=") for kv in fields.split()))
    with pytest.raises(ConfigError, match=msg):
        validate_case(case)
        get_scheme(case.run.scheme).check(case)
