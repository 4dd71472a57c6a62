"""Local work counts as progress for the hang detector; a deadlock does not (issue 20,
sec. 8: under load a 4-rank BPipe case tripped the 60 s detector while its ranks trained
their golden runs). ``WorkerContext.working`` beats while the rank works and falls silent
while it waits in a collective; a rank waiting in a collective is excused while another rank
still makes progress (the fast rank at the first step's barrier), not when a rank is silent
outside any collective."""
from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from parbench.launch import RankHang, WorkerPool
from parbench.worker import WorkerContext

HANG_S = 2.0


def _golden_like(ctx, seconds: float):
    with ctx.working("golden run"):
        time.sleep(seconds)  # local work that reports no step, longer than HANG_S
    return ctx.rank


def _one_rank_works_the_other_waits(ctx, seconds: float):
    if ctx.rank == 0:
        with ctx.working("golden run"):
            time.sleep(seconds)  # the slow rank's golden run ...
    dist.barrier()  # ... which the fast rank waits for at the first step's barrier
    return ctx.rank


def _silent(ctx, seconds: float):
    if ctx.rank == 1:
        time.sleep(seconds)  # no progress, in no collective
    dist.barrier()
    return ctx.rank


def test_local_work_is_progress_and_so_is_waiting_for_it(pools):
    pool = pools(2)
    assert pool.run(_golden_like, 3 * HANG_S, hang_timeout_s=HANG_S) == [0, 1]
    assert pool.run(_one_rank_works_the_other_waits, 3 * HANG_S,
                    hang_timeout_s=HANG_S) == [0, 1]


def test_a_silent_rank_is_still_a_hang_while_another_waits_for_it():
    with WorkerPool(2, timeout_s=60) as pool:
        with pytest.raises(RankHang) as e:  # the task would end after 40 s: the detector
            pool.run(_silent, 20 * HANG_S, hang_timeout_s=HANG_S)
    assert f"hung: rank 1, no progress for {HANG_S:g} s" in str(e.value), str(e.value)


def test_the_heartbeat_beats_during_work_and_is_silent_in_a_collective():
    beats: list[str] = []
    inside = threading.Event()
    ctx = WorkerContext(0, 1, "cpu", "gloo", progress=beats.append,
                        in_collective=inside.is_set)
    with ctx.working("golden run", every_s=0.01):
        while len(beats) < 4:  # "golden run", then beats while working
            time.sleep(0.01)
        inside.set()  # a collective begins: no beat until it ends
        quiet = len(beats)
        time.sleep(0.2)
        assert len(beats) <= quiet + 1  # at most a beat already under way
        inside.clear()
        while len(beats) < quiet + 3:
            time.sleep(0.01)
    assert beats[0] == "golden run" and all(b.startswith("golden run (") for b in beats[1:])
