"""Closed forms of dropless expert parallelism (``analytic.expert_dropless``, MegaBlocks) and of
FasterMoE's shadow experts (``analytic.expert_shadow``) against hand counts on made-up
routings; the reference router's counts (``parbench.golden.reference_loads``) and the router skew of
``parbench.model.moe``."""
from __future__ import annotations

import pytest
import torch

from parbench.analytic.expert import rank_states
from parbench.analytic.expert_dropless import (dropless_prediction, dropless_step,
                                               padded_a2a_wire, token_rows)
from parbench.analytic.expert_shadow import choose_shadows, expert_numel, shadow_step
from parbench.analytic.shape import Shape
from parbench.config import CaseConfig, ModelConfig
from parbench.golden import reference_loads
from parbench.model.moe import RoutingGroups, router_logits
from parbench.overrides import apply_overrides

# tiny: h 32, f 128, 1 MoE layer here; 4 experts
TINY = dict(vocab_size=128, hidden_size=32, num_layers=1, num_heads=4, seq_length=16,
            num_experts=4)
#: one layer, one micro-batch, ep = dp = 4: dp rank q's counts per expert (rank q owns q)
LOADS = [[[4, 1, 2, 3], [0, 5, 1, 2], [3, 3, 0, 2], [1, 1, 1, 5]]]


def test_token_rows_by_hand():
    # rank 0 owns expert 0: sends 1 + 2 + 3, receives 0 + 3 + 1
    assert token_rows(LOADS[0], 0, 4, 4) == (6, 4)
    # rank 3 owns expert 3: sends 1 + 1 + 1, receives 3 + 2 + 2
    assert token_rows(LOADS[0], 3, 4, 4) == (3, 7)
    # ep = 2 over dp = 4: ep groups {0, 1} and {2, 3}; ep rank 0 owns experts {0, 1}, ep
    # rank 1 {2, 3}
    assert token_rows(LOADS[0], 1, 2, 4) == (0 + 5, 2 + 3)
    assert token_rows(LOADS[0], 2, 2, 4) == (0 + 2, 1 + 1)
    # a shadowed expert's tokens stay home
    assert token_rows(LOADS[0], 0, 4, 4, skip={3}) == (3, 4)


def test_dropless_step_by_hand():
    shape = Shape(**TINY)
    st = dropless_step(shape, ep=4, dp=4, rank=0, loads=LOADS, num_microbatches=1)
    # counts: 3/4 of 4 x 8 B; tokens: 2 (6 + 4) rows of 32 x 4 B, 4 calls
    assert st.wire["ep"] == 24 + 2 * 10 * 128 == 2584 and st.calls["ep"] == 5
    # the dense all-reduce over dp = 4 (edp = 1: no expert all-reduce)
    assert set(st.calls) == {"ep", "dp"} and st.calls["dp"] == 1
    one = dropless_step(shape, ep=1, dp=4, rank=0, loads=LOADS, num_microbatches=1)
    assert "ep" not in one.wire and set(one.calls) == {"dp", "edp"}


def test_shadow_choice_ties_to_the_lower_id():
    assert choose_shadows([5, 7, 7, 1], 1) == [1]
    assert choose_shadows([5, 7, 7, 1], 2) == [1, 2]
    assert choose_shadows([3, 3, 3, 3], 2) == [0, 1]
    assert choose_shadows([3, 0, 9, 3], 0) == []


def test_shadow_step_by_hand():
    shape = Shape(**TINY)
    p = expert_numel(shape) * 4
    assert p == (2 * 32 * 128 + 128 + 32) * 4 == 33408
    # global counts 8, 10, 4, 12: expert 3 (owner: rank 3) is shadowed
    gather = 3 * 4 * 8  # all-gather of 4 ranks x 4 counts, 3/4 leaves
    wire = {r: shadow_step(shape, ep=4, dp=4, rank=r, loads=LOADS, num_microbatches=1,
                           shadows=1)[0].wire["ep"] for r in range(4)}
    # rank 0: broadcast chain 3 -> 0 -> 1 -> 2 (forwards), reduce (not the root);
    # tokens out 1 + 2, in 0 + 3 + 1
    assert wire[0] == gather + p + 2 * (3 + 4) * 128 + p
    # rank 3, the owner: sends the broadcast, not the reduce; nothing comes in for expert 3
    assert wire[3] == gather + p + 2 * (3 + 0) * 128
    # rank 2, the chain's last: no broadcast bytes; out 3 + 3, in 2 + 1 + 1
    assert wire[2] == gather + 2 * (6 + 4) * 128 + p
    step, a2a = shadow_step(shape, ep=4, dp=4, rank=2, loads=LOADS, num_microbatches=1,
                            shadows=1)
    assert step.calls["ep"] == 1 + 1 + 4 + 1 and a2a == 2 * 10 * 128
    # no shadow: the dropless tokens, an all-gather instead of the counts all-to-all
    none, _ = shadow_step(shape, ep=4, dp=4, rank=0, loads=LOADS, num_microbatches=1,
                          shadows=0)
    assert none.wire["ep"] == gather + 2 * 10 * 128


def test_prediction_and_the_padded_headline():
    shape = Shape(**TINY)
    # micro-batch 2 x 16 tokens: C = T = 32 at cf 0; 4 x 3/4 x 4 x 32 x 32 x 4 B per layer
    assert padded_a2a_wire(shape, ep=4, micro_batch_size=2, num_microbatches=1,
                           capacity_factor=0.0) == 4 * 3 * 4 * 32 * 32 * 4 // 4
    assert padded_a2a_wire(shape, ep=1, micro_batch_size=2, num_microbatches=1,
                           capacity_factor=0.0) == 0
    pred = dropless_prediction(ModelConfig(**TINY), ep=4, dp=4, micro_batch_size=2,
                               num_microbatches=1, loads=[[LOADS[0]]])
    assert len(pred.steps) == 1 and len(pred.steps[0]) == 4
    assert pred.states == rank_states(shape, 4)
    f = pred.figures
    assert f["ep_wire_bytes_all_ranks"] == sum(float(s.wire["ep"]) for s in pred.steps[0])
    assert f["ep_bytes_vs_padded"] == f["ep_wire_bytes_all_ranks"] \
        / f["alltoall_padded_ep_wire_bytes_all_ranks"] < 1


def _case(**ov) -> CaseConfig:
    base = {"scheme": "expert.dropless", "model": "tiny", "num_experts": "4", "ep": "2",
            "dp": "2", "micro_batch_size": "2", "num_microbatches": "2",
            "moe_capacity_factor": "0", "steps": "2"}
    return apply_overrides(CaseConfig(), {**base, **{k: str(v) for k, v in ov.items()}})


def test_reference_loads_cover_every_group_and_follow_the_skew():
    groups = RoutingGroups(rows=2)  # one group per rank and micro-batch of 2 samples
    loads = reference_loads(_case(), 2, groups)
    # 2 steps, 2 MoE layers, dp 2 x m 2 = 4 groups of 2 x 16 tokens, top-1
    assert [len(step) for step in loads] == [2, 2]
    assert all(len(layer) == 4 and all(sum(g) == 32 for g in layer)
               for step in loads for layer in step)
    skewed = reference_loads(_case(moe_router_skew=2), 1, groups)[0]
    total = [sum(g[e] for layer in skewed for g in layer) for e in range(4)]
    assert total[0] == max(total) and total[0] > total[3]


def test_router_skew_zero_changes_nothing():
    x, w = torch.randn(10, 8), torch.randn(4, 8)
    assert torch.equal(router_logits(x, w), x @ w.t())
    assert torch.equal(router_logits(x, w, 0.0, 0.5), x @ w.t())
    skewed = router_logits(x, w, 3.0, 0.5)
    torch.testing.assert_close(skewed - x @ w.t(),
                               -1.5 * torch.tensor([0.0, 1 / 3, 2 / 3, 1.0]).expand(10, 4))
    assert ModelConfig().moe_router_skew == 0


def test_errors_name_the_field():
    from parbench.analytic.expert_shadow import shadow_prediction
    with pytest.raises(ValueError, match="moe_shadow=5 exceeds num_experts=4"):
        shadow_prediction(ModelConfig(**TINY), ep=2, dp=2, micro_batch_size=1, num_microbatches=1,
                          loads=[], shadows=5)
