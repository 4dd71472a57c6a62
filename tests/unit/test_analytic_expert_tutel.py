"""Closed forms of ``expert.tutel`` (``parbench.analytic.expert_tutel``) against hand counts:
the adaptive capacity agreed over an ep group and capped by the Switch bound, the bytes of the
flat and 2-D all-to-alls and of the DP mode's gather / reduce-scatter, the adaptive rule's
threshold, and a whole step's per-rank prediction from synthetic router counts; plus the
2-D all-to-all's node grid (``impls.expert.hier_a2a``)."""
from __future__ import annotations

from fractions import Fraction

import pytest

from impls.expert import hier_a2a
from parbench.analytic import expert_tutel as tutel
from parbench.analytic.shape import Shape
from parbench.config import CaseConfig
from parbench.overrides import apply_overrides

# tiny: h 32, f 128, 2 layers (moe_every 1: both MoE), s 16; 4 experts
TINY = dict(vocab_size=128, hidden_size=32, num_layers=2, num_heads=4, seq_length=16,
            num_experts=4)


def shape(**ov) -> Shape:
    return Shape(**{**TINY, **ov})


def test_expert_numel_and_phases():
    assert tutel.expert_numel(shape()) == 2 * 32 * 128 + 128 + 32 == 8352
    assert tutel.a2a_phases(4, "flat") == [("ep", 4)]
    assert tutel.a2a_phases(4, "2d") == [("ep_intra", 2), ("ep_inter", 2)]
    assert tutel.a2a_phases(8, "2d") == [("ep_intra", 2), ("ep_inter", 4)]
    assert tutel.a2a_phases(2, "2d") == [("ep_intra", 2)]  # one node: no inter-node phase
    assert tutel.a2a_wire_factor(4, "flat") == Fraction(3, 4)
    assert tutel.a2a_wire_factor(4, "2d") == 1  # 1/2 + 1/2: more bytes, 2 peers not 3
    assert tutel.a2a_wire_factor(8, "2d") == Fraction(1, 2) + Fraction(3, 4)
    with pytest.raises(ValueError, match="multiple of 2"):
        tutel.a2a_phases(3, "2d")
    assert tutel.RANKS_PER_NODE == hier_a2a.RANKS_PER_NODE


def test_capacity_is_the_groups_largest_need_capped_by_the_bound():
    # one layer, 2 micro-batches, 4 ranks (groups r*2 + i), 2 experts
    layer = [[3, 1], [2, 2], [5, 0], [1, 1], [0, 4], [2, 7], [1, 1], [1, 1]]
    assert tutel.capacities([layer], rank=0, ep=2, num_microbatches=2, bound=None) == [5, 2]
    assert tutel.capacities([layer], rank=1, ep=2, num_microbatches=2, bound=None) == [5, 2]
    assert tutel.capacities([layer], rank=2, ep=2, num_microbatches=2, bound=None) == [4, 7]
    assert tutel.capacities([layer], rank=3, ep=4, num_microbatches=2, bound=None) == [5, 7]
    assert tutel.capacities([layer], rank=2, ep=2, num_microbatches=2, bound=6) == [4, 6]
    assert tutel.local_needs([layer], rank=1, num_microbatches=2, bound=None) == [5, 1]


def test_layer_bytes_by_hand():
    s = shape()
    tr, mode = tutel.layer_transfers(s, 2, "flat", "ep", 12)
    assert mode == "ep"
    assert [(t.axis, t.op, t.message_bytes, t.count) for t in tr] == [
        ("ep", "all_reduce", 8, 1), ("ep", "all_to_all", 4 * 12 * 32 * 4, 4)]
    tr, _ = tutel.layer_transfers(s, 4, "2d", "ep", 10)
    assert sum(t.total_wire_bytes for t in tr) == Fraction(2 * 3, 4) * 8 + 4 * 5120 * (1 + 0)
    assert {t.axis for t in tr} == {"ep", "ep_intra", "ep_inter"}
    tr, mode = tutel.layer_transfers(s, 2, "flat", "dp", 12)
    assert mode == "dp"  # no capacity agreement, experts gathered and reduce-scattered
    assert [(t.op, t.message_bytes) for t in tr] == [("all_gather", 4 * 8352 * 4),
                                                     ("reduce_scatter", 4 * 8352 * 4)]
    assert tutel.layer_transfers(s, 1, "flat", "ep", 12)[0] == []


def test_adaptive_threshold():
    # flat: ep iff 4 C h <= 2 P_e, P_e = 65 f + 32; f = 12: P_e = 812, C <= 12.69
    s = shape(ffn_hidden_size=12)
    assert tutel.chosen_mode("adaptive", 12, s, 2, "flat") == "ep"
    assert tutel.chosen_mode("adaptive", 13, s, 2, "flat") == "dp"
    # 2-D on 4 ranks: 4 C h (1/2 + 1/2) <= 2 P_e 3/4: C <= 9.5
    assert tutel.chosen_mode("adaptive", 9, s, 4, "2d") == "ep"
    assert tutel.chosen_mode("adaptive", 10, s, 4, "2d") == "dp"
    assert tutel.chosen_mode("ep", 10 ** 6, s, 4, "2d") == "ep"


def case(**ov) -> CaseConfig:
    base = {"scheme": "expert.tutel", "model": "tiny", "num_experts": "4", "steps": "1",
            "micro_batch_size": "2", "num_microbatches": "2", "ep": "2", "dp": "4",
            "moe_capacity_factor": "0"}
    return apply_overrides(CaseConfig(), {**base, **{k: str(v) for k, v in ov.items()}})


def synthetic_counts() -> list:
    """One step, 2 MoE layers, 8 groups (4 ranks x 2 micro-batches), 4 experts."""
    a = [[10, 8, 8, 6], [12, 8, 6, 6], [9, 9, 9, 5], [8, 8, 8, 8],
         [16, 8, 4, 4], [8, 8, 8, 8], [8, 8, 8, 8], [7, 9, 8, 8]]
    return [[a, [list(reversed(g)) for g in a]]]


def test_step_prediction_per_rank():
    c = case(ffn_hidden_size=12, moe_mode="adaptive")
    pred = tutel.tutel_prediction(c, synthetic_counts())
    h, e = 32, 4
    # ranks 0, 1 (ep group 0): C = 10, 12 per layer; all <= 12: ep
    assert pred.figures["capacity_per_step_rank0"] == [[10, 12, 10, 12]]
    assert pred.figures["mode_per_step_rank0"] == [["ep"] * 4]
    w0 = pred.wire[0][0]["ep"]
    assert w0 == 4 * 8 + sum(4 * e * cap * h * 4 // 2 for cap in (10, 12, 10, 12))
    # ranks 2, 3 (ep group 1): C = 16 (dp), 9 (ep) per layer
    w2 = pred.wire[0][2]["ep"]
    dp_bytes = 2 * e * 812 * 4 // 2
    assert w2 == 4 * 8 + 2 * dp_bytes + 2 * (4 * e * 9 * h * 4 // 2)
    assert pred.calls[0][2] == {"ep": 4 + 2 * 2 + 2 * 4, "dp": 1, "edp": 1}
    assert pred.calls[0][0] == {"ep": 4 + 4 * 4, "dp": 1, "edp": 1}
    by_mode = pred.figures["moe_wire_bytes_rank0_by_mode"]
    assert by_mode["adaptive"] == by_mode["ep"] == w0 < by_mode["dp"]


def test_bound_caps_the_capacity():
    pred = tutel.tutel_prediction(case(moe_capacity_factor=1.0), synthetic_counts())
    assert pred.figures["capacity_bound"] == 8  # ceil(32 / 4)
    assert pred.figures["capacity_per_step_rank0"] == [[8, 8, 8, 8]]


def test_node_partitions():
    intra, inter = hier_a2a.node_partitions([[0, 1, 2, 3], [4, 5, 6, 7]], 2)
    assert intra == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert inter == [[0, 2], [1, 3], [4, 6], [5, 7]]
    with pytest.raises(ValueError):
        hier_a2a.node_partitions([[0, 2, 1, 3]], 2)
