"""A split backward's W on an eager framework: the engine's re-entries and walks
(``parbench.timemodel.split_backward_cost``) and what ``calibrate`` measures for them
(``parbench.calibration.reentry``)."""
import pytest
import torch

from parbench.analytic.shape import Shape, shape_from
from parbench.calibration.local_model import LocalLayer
from parbench.calibration.plan import model_config
from parbench.calibration.reentry import CHAIN, graph_counts, reentry_costs
from parbench.model.gpt import Block
from parbench.timemodel import Training, predict_step
from parbench.timemodel.profile import Link, Profile
from parbench.timemodel.split_backward_cost import HEAD_WEIGHT_NODES, w_reentry_s

MID = Shape(vocab_size=32000, hidden_size=2048, num_layers=16, num_heads=16, seq_length=1024)


def _profile(reentry: float, walk: float, counted: bool = True, call: float = 0.0) -> Profile:
    parts = [{"kind": "layer", "b": 1, "s": 1024, "tp": 1, "h": 2048, "heads": 16, "f": 8192,
              "kv": 2048, "vocab": 32000, "dtype": "bf16", "gated": False,
              "fwd_s": 1e-3, "bwd_s": 2e-3, **({"graph_nodes": 43, "weight_nodes": 6}
                                                if counted else {})}]
    return Profile(name="p", device="cpu", calibrated=True, memory_bytes=80e9,
                   matmul_flops={"bf16": 100e12, "fp32": 25e12}, mem_bandwidth=2e12,
                   backward_call_s=call, grad_reentry_s=reentry, graph_walk_s=walk,
                   parts=parts, optimizer={"per_tensor_s": 0.0, "bytes_per_element": 32.0},
                   links={"intra": Link(200e9, 5e-6)})


def test_w_costs_a_reentry_per_weight_node_and_a_walk_below_each():
    """4 layers of 43 nodes, 6 of them weight nodes; the last stage adds the head's 2: 26
    re-entries, and 43 (6 x 16 / 2 + 2 x 4) = 2408 nodes walked; a middle stage 24 and
    43 x 48 = 2064; the first stage none (its W is one pass)."""
    prof = _profile(10e-6, 0.1e-6)
    assert w_reentry_s(prof, MID, 1, 4, False, True) == pytest.approx(
        26 * 10e-6 + 2408 * 0.1e-6)
    assert w_reentry_s(prof, MID, 1, 4, False, False) == pytest.approx(
        24 * 10e-6 + 2064 * 0.1e-6)
    assert w_reentry_s(prof, MID, 1, 4, True, False) == 0.0
    assert HEAD_WEIGHT_NODES == 2


def test_without_the_measurements_w_pays_one_backward_call_per_linear():
    for prof in (_profile(0.0, 0.0, call=7e-6), _profile(10e-6, 0.1e-6, counted=False,
                                                         call=7e-6)):
        assert w_reentry_s(prof, MID, 1, 4, False, True) == pytest.approx(17 * 7e-6)
        assert w_reentry_s(prof, MID, 1, 4, False, False) == pytest.approx(16 * 7e-6)


def test_zero_bubbles_busiest_rank_pays_its_stages_reentries_fused_1f1b_none():
    def busy(schedule, prof):
        lay = Training.of(pp=4, num_microbatches=8, schedule=schedule)
        return predict_step(MID, lay, prof, bound=True).step_s
    on, off = _profile(10e-6, 0.1e-6), _profile(0.0, 0.0)
    last = w_reentry_s(on, MID, 1, 4, False, True)
    # the simulator rounds each stage's cost to 3 significant figures (pipeline_time): 2%
    assert busy("zb-h1", on) - busy("zb-h1", off) >= 0.98 * 8 * last
    assert busy("1f1b", on) == pytest.approx(busy("1f1b", off))


@pytest.mark.parametrize("name", ["tiny", "llama-tiny"])
def test_graph_counts_find_the_layers_weight_nodes(name):
    """4 linears (QKV, projection, fc1, fc2) and 2 norms re-entered by W; the calibrated
    layer's graph counted as the reference Block's."""
    cfg = model_config(name)
    x = torch.randn(1, cfg.seq_length, cfg.hidden_size)
    counts = graph_counts(LocalLayer(shape_from(cfg), 1), x)
    assert counts["weight_nodes"] == 6
    assert counts == graph_counts(Block(cfg, 0), x)


def test_reentry_costs_take_the_intercept_and_the_slope_over_the_chain():
    seen = iter([12e-6, 28e-6])
    calls = []

    def timer(fn):
        fn()  # the re-entering call runs
        calls.append(fn)
        return next(seen)
    out = reentry_costs("cpu", timer)
    walk = 16e-6 / (CHAIN[1] - CHAIN[0])
    assert len(calls) == 2
    assert out["graph_walk_s"] == pytest.approx(walk)
    assert out["grad_reentry_s"] == pytest.approx(12e-6 - CHAIN[0] * walk)
