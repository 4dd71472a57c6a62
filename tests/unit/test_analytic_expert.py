"""Closed forms of expert parallelism (``parbench.analytic.expert``) against hand counts of the
tiny MoE model, Switch Eq. 3's capacity and GShard's all-to-all volume, and against the
reference model's own parameters and capacity."""
from __future__ import annotations

import pytest

from parbench.analytic import expert_traffic, summarize
from parbench.analytic.expert import (alltoall_traffic, capacity, expert_prediction,
                                      gradient_traffic, rank_states, rank_tensors)
from parbench.analytic.shape import Shape
from parbench.config import ModelConfig, model_preset
from parbench.model import build_model
from parbench.model.moe import capacity as reference_capacity

# tiny: V 128, h 32, 2 layers, s 16, f 128; 4 experts
TINY = dict(vocab_size=128, hidden_size=32, num_layers=2, num_heads=4, seq_length=16,
            num_experts=4)


def tiny(**ov) -> Shape:
    return Shape(**{**TINY, **ov})


def test_capacity_is_switch_eq3_per_group():
    assert capacity(32, 4, 1, 1.0) == 8  # ceil(32 / 4)
    assert capacity(32, 4, 2, 1.25) == 20  # ceil(1.25 * 2 * 32 / 4)
    assert capacity(32, 4, 1, 1.25) == 10
    assert capacity(16, 4, 2, 0.0) == 16  # no limit: a token takes one slot of an expert
    assert capacity(40, 4, 1, 1.1) == 11  # the decimal 1.1, not binary 1.1000000000000000888
    for args in [(32, 4, 1, 1.0), (32, 4, 2, 1.25), (16, 4, 2, 0.0), (40, 4, 1, 1.1),
                 (24, 8, 2, 0.5), (7, 3, 1, 2.0)]:
        t, e, k, cf = args
        assert capacity(*args) == reference_capacity(cf, k, t, e)


def test_rank_tensors_by_hand():
    dense, expert = rank_tensors(tiny(), ep=2)
    # embedding 128*32 + 16*32; per layer LN 64, QKV 3*1024+96, proj 1024+32, LN 64, router
    # 4*32; head LN 64 + 128*32
    assert sum(dense) == 4608 + 2 * (64 + 3168 + 1056 + 64 + 128) + 4160 == 17728
    assert len(dense) == 2 + 2 * 9 + 3
    # 2 experts x 2 layers x (32*128 + 128 + 128*32 + 32)
    assert sum(expert) == 2 * 2 * 8352 == 33408 and len(expert) == 16


def test_rank_tensors_match_the_reference_model():
    for ov in [{}, {"num_layers": 4, "moe_every": 2}, {"tie_embeddings": True},
               {"position_embeddings": False, "num_experts": 8}]:
        cfg = ModelConfig(**{**TINY, **ov})
        names = {n: p.numel() for n, p in build_model(cfg, 0).named_parameters()}
        dense, expert = rank_tensors(Shape(**{**TINY, **ov}), ep=1)
        assert sorted(dense) == sorted(v for n, v in names.items() if ".experts." not in n)
        assert sorted(expert) == sorted(v for n, v in names.items() if ".experts." in n)


def test_alltoall_traffic_is_gshard_four_per_layer():
    # T = 2 x 16 = 32 tokens, C = 8, buffer E C h e = 4 x 8 x 32 x 4 = 4096 B; 2 MoE layers,
    # 2 micro-batches, 4 all-to-alls each: 16 calls, half of each buffer leaves (ep = 2)
    tr = alltoall_traffic(tiny(), ep=2, micro_batch_size=2, num_microbatches=2)
    assert {(t.op, t.message_bytes, t.count) for t in tr} == {("all_to_all", 4096, 4)}
    ep = summarize(tr)["ep"]
    assert (ep["count"], ep["message_bytes"], ep["wire_bytes"]) == (16, 16 * 4096, 16 * 2048)
    # the same volume as the general traffic model at this capacity
    general = summarize(expert_traffic(32, 32, 2, moe_layers=2, num_microbatches=2,
                                       bytes_per_element=4, capacity_factor=1.0,
                                       num_experts=4))["ep"]
    assert general["wire_bytes"] == ep["wire_bytes"]
    # ep = 4: 3/4 of the buffer leaves; moe_every = 2 on 4 layers: 2 MoE layers
    four = summarize(alltoall_traffic(tiny(num_layers=4, moe_every=2), 4, 2, 1))["ep"]
    assert four["wire_bytes"] == 2 * 4 * 4096 * 3 // 4
    assert not [t for t in alltoall_traffic(tiny(), ep=1, micro_batch_size=2) if t.count]


def test_gradient_traffic_dense_over_dp_experts_over_edp():
    dp_ar, edp_ar = gradient_traffic(tiny(), ep=2, dp=4)
    assert (dp_ar.axis, dp_ar.group_size, dp_ar.message_bytes) == ("dp", 4, 17728 * 4)
    assert dp_ar.total_wire_bytes == 2 * 3 * 17728 * 4 // 4 == 106368
    assert (edp_ar.axis, edp_ar.group_size, edp_ar.message_bytes) == ("edp", 2, 33408 * 4)
    assert edp_ar.total_wire_bytes == 33408 * 4 == 133632  # 2 (n-1)/n = 1 at n = 2
    _, edp1 = gradient_traffic(tiny(), ep=2, dp=2)
    assert edp1.count == 0  # edp = 1: nothing to reduce
    with pytest.raises(ValueError, match="ep=4 does not divide dp=2"):
        gradient_traffic(tiny(), ep=4, dp=2)


def test_states_and_prediction_by_hand():
    st = rank_states(tiny(), ep=2)
    psi = 17728 + 33408
    assert st == {"params": 4 * psi, "grads": 4 * psi, "optimizer": 8 * psi + 4 * 39,
                  "other": 0}
    pred = expert_prediction(ModelConfig(**TINY), ep=2, dp=4, micro_batch_size=2, num_microbatches=2)
    assert pred.wire_bytes == {"ep": 16 * 2048, "dp": 106368, "edp": 133632}
    assert pred.calls == {"ep": 16, "dp": 1, "edp": 1}
    f = pred.figures
    assert (f["capacity"], f["a2a_message_bytes"], f["a2a_wire_bytes_per_moe_layer"],
            f["a2a_per_moe_layer_per_microbatch"]) == (8, 4096, 8192, 4)
    one = expert_prediction(ModelConfig(**TINY), ep=1, dp=1, micro_batch_size=2)
    assert one.wire_bytes == {} and one.calls == {}


def test_errors_name_the_field():
    with pytest.raises(ValueError, match="num_experts=0"):
        expert_prediction(model_preset("tiny"), ep=1, dp=1, micro_batch_size=1)
    with pytest.raises(ValueError, match="ep=3 does not divide num_experts=4"):
        rank_tensors(tiny(), ep=3)
