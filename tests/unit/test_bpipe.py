"""BPipe's schedule, eviction plan and closed forms (Kim et al. 2023, Sec. 3)."""
from __future__ import annotations

import pytest
import torch

from parbench.analytic import pipeline_bpipe as closed
from parbench.analytic.shape import shape_from
from parbench.config import model_preset
from parbench.model import build_stage
from parbench.schedules import ScheduleError, make_schedule, simulate, validate
from parbench.schedules.bpipe import (
    ACCEPT,
    PairOp,
    check_plan,
    eviction_plan,
    evicted_microbatches,
    threshold,
)

from impls.pipeline.bpipe_memory import EvictableActivations


def test_threshold_is_ceil_of_p_plus_2_over_2_on_both_sides():
    for p in range(1, 40):
        assert threshold(p) == closed.threshold(p) == -(-(p + 2) // 2)
    assert [closed.threshold(p) for p in (2, 4, 8, 16)] == [2, 3, 5, 9]


def test_closed_form_count_equals_the_generators_greedy_rule():
    """E(x) = floor(m/w) d + max(0, m mod w - (w-d)) is what the evict-the-latest rule does."""
    for p in range(2, 13):
        for m in range(1, 41):
            s = make_schedule("bpipe", p, m)
            for x in range(p):
                got = len(evicted_microbatches(s.actions[x], threshold(p))) if 2 * x < p - 1 \
                    else 0
                assert got == closed.evicted_count(p, m, x), (p, m, x)
    assert [closed.evicted_count(8, 16, x) for x in range(8)] == [6, 4, 3, 0, 0, 0, 0, 0]
    assert closed.evicted_count(4, 8, 0) == 2 and closed.evicted_count(2, 8, 0) == 0


@pytest.mark.parametrize("p,m", [(4, 8), (5, 9), (6, 13), (8, 16), (8, 5), (3, 6), (2, 4)])
def test_plan_bounds_evictors_and_is_deadlock_free(p, m):
    s = validate(make_schedule("bpipe", p, m))
    assert s.actions == make_schedule("1f1b", p, m).actions  # BPipe's compute order is 1F1B
    plan = eviction_plan(s)  # check_plan ran inside
    in_flight = simulate(s).peak_inflight
    for x in range(p):
        peak = max(plan.resident(s, x))
        if x in plan.evicted:
            assert peak == closed.threshold(p) < in_flight[x] == min(p - x, m)
        else:
            assert peak == in_flight[x]
    # every eviction is loaded back by the same pair, in micro-batch order on both sides
    for x, mbs in plan.evicted.items():
        a = p - 1 - x
        assert [o.mb for o in plan.ops[x] if o.kind == "evict"] == mbs
        assert [o.mb for o in plan.ops[a] if o.kind == "give_back"] == mbs
        assert all(o.peer == a for o in plan.ops[x]) and all(o.peer == x for o in plan.ops[a])


def test_a_late_accept_is_reported_as_a_deadlock():
    s = make_schedule("bpipe", 4, 8)
    plan = eviction_plan(s)
    end = len(s.actions[3])
    plan.ops[3] = [PairOp(ACCEPT, o.mb, o.peer, end) if o.kind == ACCEPT else o
                   for o in plan.ops[3]]
    with pytest.raises(ScheduleError, match="deadlock"):
        check_plan(s, plan)


def test_bad_arguments_are_refused():
    with pytest.raises(ScheduleError, match="split_backward"):
        make_schedule("bpipe", 4, 8, split_backward=True)
    with pytest.raises(ScheduleError, match="threshold=1"):
        eviction_plan(make_schedule("bpipe", 4, 8), limit=1)
    with pytest.raises(ValueError, match="last stage"):
        closed.saved_bytes_per_microbatch(shape_from(model_preset("tiny-8l")), 1, 4, 3)


@pytest.mark.parametrize("b,stage", [(1, 0), (2, 1), (3, 2)])
def test_saved_bytes_closed_form_equals_what_autograd_saves(b, stage):
    """A(x) = L/S * 4 (8bsh + 2bsf + (4+a)bs) bytes, as the executor's hooks count them on the
    reference model (the stage input included, weights and tokens not)."""
    cfg = model_preset("tiny-8l")
    shape = shape_from(cfg)
    assert closed.saved_bytes_check(shape, b)
    mod = build_stage(cfg, 0, stage, 4)
    tokens = torch.zeros(b, cfg.seq_length, dtype=torch.long)
    x = tokens if stage == 0 else torch.randn(b, cfg.seq_length, cfg.hidden_size,
                                              requires_grad=True)
    acts = EvictableActivations()
    acts.capture = ("mb",)
    with acts.forward([*mod.parameters(), tokens]):
        out = mod(x, tokens)
    assert acts.bytes == closed.saved_bytes_per_microbatch(shape, b, 4, stage)
    assert acts.pack_handle(("mb",)).numel() == acts.bytes
    del out


def _evict_and_backward(corrupt: bool):
    """Gradients of a stage whose saved activations were evicted and loaded back, and the
    same stage's gradients without eviction."""
    cfg = model_preset("tiny-8l")
    mods = [build_stage(cfg, 0, 1, 4) for _ in range(2)]
    xs = [torch.randn(2, cfg.seq_length, cfg.hidden_size, generator=torch.Generator()
                      .manual_seed(3)).requires_grad_(True) for _ in range(2)]
    acts = EvictableActivations()
    acts.capture = "k"
    with acts.forward(list(mods[0].parameters())):
        out = mods[0](xs[0])
    flat = acts.pack_handle("k")
    held = acts.bytes
    assert acts.drop("k") == held and acts.bytes == 0 and acts.bytes_unevicted == held
    assert acts.resident == 0
    acts.restore("k", torch.zeros_like(flat) if corrupt else flat.clone())
    assert acts.bytes == held and acts.resident == 1
    out.square().mean().backward()
    mods[1](xs[1]).square().mean().backward()
    return [(a.grad, b.grad) for a, b in zip([xs[0], *mods[0].parameters()],
                                             [xs[1], *mods[1].parameters()])]


def test_evicted_storages_come_back_bit_identical():
    assert all(torch.equal(a, b) for a, b in _evict_and_backward(corrupt=False))
    assert not all(torch.equal(a, b) for a, b in _evict_and_backward(corrupt=True))


def test_pair_traffic_is_symmetric_and_absent_without_evictions():
    shape = shape_from(model_preset("tiny-8l"))
    a = closed.saved_bytes_per_microbatch(shape, 2, 4, 0)
    assert a == 133120  # 2 layers x 4 (8*2*16*32 + 2*2*16*128 + 8*2*16)
    assert closed.pair_traffic(shape, 4, 8, 0, 2) == {"bpipe_evict": (2 * a, 2)}
    assert closed.pair_traffic(shape, 4, 8, 3, 2) == {"bpipe_load": (2 * a, 2)}
    assert closed.pair_traffic(shape, 4, 8, 1, 2) == closed.pair_traffic(shape, 4, 8, 2, 2) == {}
    assert closed.pair_traffic(shape, 2, 16, 0, 2) == {}
    assert closed.peak_resident(8, 16, 0, bpipe=False) == 8
    assert closed.peak_resident(8, 16, 0) == 5 and closed.peak_resident(8, 16, 3) == 5
