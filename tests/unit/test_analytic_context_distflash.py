"""DistFlashAttn's closed forms (``parbench.analytic.context_distflash``) against a brute-force
walk of the schedule the implementation runs (``impls.context.distflash_plan``): every causal
block computed exactly once, the per-worker block counts and message counts, at most one
message per ordered pair per kind (so NCCL's tag-less matching holds), the idle fractions of
Sec. 3.1, and the traffic of one worker by hand."""
from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from impls.context.distflash_plan import BalancedSchedule
from parbench.analytic import Shape, summarize
from parbench.analytic.context_distflash import (blocks_per_worker, idle_fraction,
                                                 rank_predictions, remat_layer_activation_bytes,
                                                 schedule_steps, unbalanced_blocks,
                                                 work_per_worker, worker_transfers)

workers = st.integers(1, 16)


def _computed_blocks(P: int) -> Counter:
    """(query chunk, key chunk) -> how many workers compute it, walking the schedule."""
    sched, seen = BalancedSchedule(P), Counter()
    for r in range(P):
        seen[(r, r)] += 1
        for task in sched.tasks(r):
            if task.local is not None:
                seen[(r, task.local)] += 1
            if task.helps is not None:
                seen[(task.helps, r)] += 1
    return seen


@given(P=workers)
def test_every_causal_block_is_computed_exactly_once(P):
    assert _computed_blocks(P) == Counter({(i, j): 1 for i in range(P) for j in range(i + 1)})


@given(P=workers)
def test_block_counts_match_the_schedule_and_balance(P):
    sched = BalancedSchedule(P)
    blocks = blocks_per_worker(P)
    assert blocks == [sched.blocks(r) for r in range(P)]
    assert sum(blocks) == P * (P + 1) // 2 == sum(unbalanced_blocks(P))
    if P % 2:  # odd P: every worker the same (P + 1)/2 blocks
        assert blocks == [(P + 1) // 2] * P
    else:  # even P: P/2 in the first half, P/2 + 1 in the second
        assert blocks == [P // 2] * (P // 2) + [P // 2 + 1] * (P // 2)
    assert max(blocks) <= max(unbalanced_blocks(P))


@given(P=workers)
def test_message_counts_match_the_schedule(P):
    """Sends of each kind per worker, walked from the schedule, against the closed form's
    counts (the transfers at b = s/P = h = a = 1 carry the counts as their names say)."""
    sched = BalancedSchedule(P)
    for r in range(P):
        tasks = sched.tasks(r)
        walked = {"K, V (fwd)": sum(t.send_kv is not None for t in tasks),
                  "queries to the helper (fwd)": sum(t.send_q is not None for t in tasks),
                  "helper's output and log-sum-exp (fwd)": sum(t.helps is not None
                                                               for t in tasks),
                  "dK, dV to their owner (bwd)": sum(t.local is not None for t in tasks)}
        got = {t.what: t.count for t in worker_transfers(1, P, 1, 1, P, r)}
        for what, count in walked.items():
            assert got.get(what, 0) == count, (P, r, what)
        assert got.get("K, V (bwd)", 0) == walked["K, V (fwd)"]
        assert got.get("helper's dQ (bwd)", 0) == walked["helper's output and log-sum-exp (fwd)"]


@given(P=workers)
def test_senders_and_receivers_agree_and_pairs_carry_one_message(P):
    sched = BalancedSchedule(P)
    sends, recvs = Counter(), Counter()
    for r in range(P):
        for t in sched.tasks(r):
            if t.send_kv is not None:
                sends[("kv", r, t.send_kv)] += 1
            if t.send_q is not None:
                sends[("q", r, t.send_q)] += 1
                recvs[("out", t.helped_by, r)] += 1
            if t.local is not None:
                recvs[("kv", t.local, r)] += 1
            if t.helps is not None:
                recvs[("q", t.helps, r)] += 1
                sends[("out", r, t.helps)] += 1
    assert sends == recvs
    pairs = Counter((src, dst) for _, src, dst in sends)
    assert max(pairs.values(), default=1) == 1
    # backward: K/V and the query bundle as in forward, dK/dV back to the K/V's owner, dQ
    # back to the helped worker -- again one message per ordered pair
    back = Counter()
    for r in range(P):
        for t in sched.tasks(r):
            for dst in (t.send_kv, t.send_q, t.local, t.helps):
                if dst is not None:
                    back[(r, dst)] += 1
    assert max(back.values(), default=1) == 1


def test_idle_fractions_of_sec_3_1():
    # the causal ring on contiguous chunks idles (P^2 - P)/(2 P^2) of the worker-steps
    for P in (2, 4, 8, 16):
        assert idle_fraction(P, balanced=False) == pytest.approx((P * P - P) / (2 * P * P))
    assert [idle_fraction(P) for P in (3, 5, 7)] == [0.0, 0.0, 0.0]
    assert [idle_fraction(P) for P in (2, 4, 8)] == pytest.approx([1 / 4, 1 / 6, 1 / 10])
    assert schedule_steps(8) == (4, 3) and schedule_steps(7) == (3, 3)


def test_work_sums_to_the_causal_triangle():
    s, P = 64, 4
    work = work_per_worker(s, P)
    assert sum(work) == s * (s + 1) // 2
    n = s // P
    assert work == [n * (n + 1) // 2 + k * n * n for k in (1, 1, 2, 2)]


def test_worker_traffic_by_hand():
    # b=1, s=16, h=8, a=2, P=4, fp32: n=4; K, V = 2*4*8*4 = 256 B; q 128 B; out+lse
    # 4*(8+2)*4 = 160 B; bundle 4*(24+2)*4 = 416 B. T=2, H=1.
    def rows(r, **kw):
        return [(t.what.split(" (")[0], t.message_bytes, t.count)
                for t in worker_transfers(1, 16, 8, 2, 4, r, **kw)]
    assert rows(0) == [("K, V", 256, 2), ("helper's output and log-sum-exp", 160, 1),
                       ("K, V", 256, 2), ("helper's dQ", 128, 1)]
    assert rows(3) == [("queries to the helper", 128, 1), ("dK, dV to their owner", 256, 2),
                       ("q, dO, O, log-sum-exp to the helper", 416, 1)]
    # the naive recompute sends the forward's messages twice, the remat-aware one does not
    assert rows(3, recompute="full") == rows(3)
    assert rows(3, recompute="selective")[0] == ("queries to the helper", 128, 2)


def test_rank_predictions_map_global_ranks_to_cp_workers():
    shape = Shape(vocab_size=61, hidden_size=8, num_layers=2, num_heads=2, seq_length=16)
    preds = rank_predictions(shape, cp=4, dp=2, micro_batch_size=1)
    cp = [p.wire_bytes["cp"] for p in preds]
    assert cp[:4] == cp[4:] and len(set(cp[:4])) > 1
    one = summarize(worker_transfers(1, 16, 8, 2, 4, 1, layers=2))["cp"]
    assert cp[1] == one["wire_bytes"]
    assert preds[0].wire_bytes["dp_cp"] == preds[5].wire_bytes["dp_cp"] > 0


def test_remat_keeps_input_output_and_lse():
    # n = 4 tokens, b = 2, h = 8, a = 2: 2 * (2*4*8*4) + 2*2*4*4 fp32 bytes
    assert remat_layer_activation_bytes(16, 2, 8, 2, 4) == 512 + 64
