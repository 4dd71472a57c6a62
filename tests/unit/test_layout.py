"""The one layout record: its rules (each stated once, each message naming field, value and
rule), its derived sizes, and the options beside it."""
from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from parbench.analytic.shape import shape_from
from parbench.config import CaseConfig, model_preset
from parbench.layout import Axis, ConfigError, Layout, model_rules, padded_vocab
from parbench.options import DataOptions, Options, option_family


def test_axis_typo_lists_the_valid_axes():
    with pytest.raises(ValueError, match="axis 'tpp' is not a mesh axis .*tp, cp"):
        Axis("tpp")
    assert Axis.TP == "tp" and Axis("dp_cp") is Axis.DP_CP


@pytest.mark.parametrize("fields, msg", [
    ({"tp": 0}, "tp=0 must be >= 1"),
    ({"etp": -1}, "etp=-1 must be >= 0 (0 = tp)"),
    ({"dp": 1.5}, "dp=1.5 must be an integer"),
    ({"dp": 4, "ep": 3}, "ep=3 does not divide cp*dp=4"),
    ({"tp": 4, "ep": 4, "etp": 2}, "etp*ep=2*4 does not divide tp*cp*dp=4"),
    ({"schedule": ""}, "schedule='' must be a schedule name"),
])
def test_a_bad_layout_fails_where_it_is_built(fields, msg):
    with pytest.raises(ConfigError) as e:
        Layout(**fields)
    assert msg in str(e.value)


def test_derived_sizes():
    lay = Layout(tp=2, cp=2, ep=4, etp=1, dp=2, pp=3, micro_batch_size=2, num_microbatches=5)
    assert lay.world_size == 24 and lay.dp_cp == 4 and lay.expert_tp == 1
    assert lay.edp == 2  # tp cp dp / (etp ep) = 8 / 4
    assert lay.size("tp_dp_cp") == 8 and lay.enabled("pp") and not lay.enabled("etp")
    assert lay.global_batch_size == 2 * 5 * 2
    assert lay.degrees() == {"tp": 2, "cp": 2, "ep": 4, "dp": 2, "pp": 3}
    assert lay.label() == "tp2-cp2-ep4-dp2-pp3" and Layout().label() == "single"
    assert lay.grid() == Layout(tp=2, cp=2, ep=4, etp=1, dp=2, pp=3)


def test_global_batch_fixes_the_micro_batches():
    lay = Layout(dp=4, micro_batch_size=2).with_global_batch(64)
    assert lay.num_microbatches == 8
    with pytest.raises(ConfigError, match="global_batch_size=60 is not a positive multiple "
                                          "of micro_batch_size\\*dp=8"):
        Layout(dp=4, micro_batch_size=2).with_global_batch(60)


def test_from_case_reads_new_and_old_case_dicts():
    case = CaseConfig(layout=Layout(tp=2, pp=2))
    assert Layout.from_case(case) == case.layout
    assert Layout.from_case(case.to_dict()) == case.layout
    old = {"parallel": {"tp": 2, "pp": 2, "sp": True, "cp_kind": "ulysses"}}
    assert Layout.from_case(old) == Layout(tp=2, pp=2)
    back = CaseConfig.from_dict(old)
    assert back.options.tensor.sp and back.options.context.cp_algorithm == "ulysses"


@pytest.mark.parametrize("fields, model, kw, msg", [
    ({"tp": 3}, "tiny", {}, "tp=3 does not divide num_heads=4"),
    ({"tp": 4}, "llama2-70b", {}, None),  # 8 K/V heads, split over tp 4
    ({"tp": 16}, "llama2-70b", {}, None),  # 8 K/V heads, each replicated twice
    ({"tp": 2, "cp": 2}, "tiny", {"sp": True}, None),
    ({"cp": 3}, "tiny", {}, "cp=3 does not divide seq_length=16"),
    ({"cp": 16}, "tiny", {"cp_balance": "zigzag"}, "2*cp=32 does not divide seq_length=16"),
    ({"tp": 4, "cp": 8}, "tiny", {"sp": True},
     "sp with tp=4 needs tp to divide seq_length/cp=16/8=2"),
    ({"pp": 3}, "tiny-8l", {}, "pp*vpp=3 does not divide num_layers=8"),
    ({"pp": 2, "vpp": 3}, "tiny-8l", {}, "pp*vpp=6 does not divide num_layers=8"),
    ({"dp": 2, "ep": 2}, "tiny", {}, "ep=2 needs an MoE model"),
])
def test_model_rules(fields, model, kw, msg):
    lay, cfg = Layout(**fields), model_preset(model)
    if msg is None:
        lay.check_model(cfg, **kw)
        assert lay.fits_model(cfg, **kw)
        return
    with pytest.raises(ConfigError) as e:
        lay.check_model(cfg, **kw)
    assert msg in str(e.value)
    assert not lay.fits_model(cfg, **kw)


def test_kv_heads_replication_rule():
    """K/V heads are split over tp or shared: tp and num_kv_heads divide one another."""
    shape = shape_from(model_preset("tiny"), hidden_size=96, num_heads=24, num_kv_heads=6)
    assert not list(model_rules(Layout(tp=2), shape))  # 3 K/V heads per rank
    assert not list(model_rules(Layout(tp=12), shape))  # each K/V head on 2 ranks
    bad = list(model_rules(Layout(tp=4), shape))  # 4 ranks share 6 heads unevenly
    assert bad == ["tp=4 and num_kv_heads=6: one must divide the other (K/V heads are split "
                   "over tp, or each shared by tp/num_kv_heads ranks)"]


def test_the_rules_read_analytic_shapes_and_configs_alike():
    cfg = model_preset("gpt3-175b")
    for tp in (1, 2, 3, 4, 6, 8):
        lay = Layout(tp=tp)
        assert lay.fits_model(cfg, sp=True) == lay.fits_model(shape_from(cfg), sp=True)


@given(v=st.integers(1, 10**6), tp=st.integers(1, 64), div=st.sampled_from([1, 64, 128]))
def test_padded_vocabulary_is_the_smallest_multiple(v, tp, div):
    p = padded_vocab(v, tp, div)
    assert p >= v and p % (tp * div) == 0 and p - v < tp * div


def test_options_check_their_fields_once():
    with pytest.raises(ConfigError, match="cp_balance='zig' must be one of none, zigzag"):
        Options().with_values(cp_balance="zig")
    with pytest.raises(ConfigError, match="bucket_mb=0 must be > 0"):
        DataOptions(bucket_mb=0)
    assert DataOptions(bucket_mb=math.inf).bucket_mb == math.inf
    with pytest.raises(ConfigError, match="recompute='some' must be one of none"):
        Options(recompute="some")
    assert option_family("cp_window") == "context" and option_family("recompute") is None
    with pytest.raises(ConfigError, match="'cp_kind' is not an option"):
        option_family("cp_kind")
