"""The CPU split of a timed step (issue 24's measured reasons, ``parbench.thread_cpu``): the
calling thread's CPU beside the backend threads' by name, on a real 2-rank gloo case."""
from __future__ import annotations

import sys
import threading

import pytest

from parbench import thread_cpu
from parbench.config import CaseConfig
from parbench.overrides import apply_overrides
from parbench.runner import case_row

LINUX = sys.platform.startswith("linux")


def test_a_row_splits_its_cpu_between_its_own_thread_and_the_backends(pools):
    case = apply_overrides(CaseConfig(), {"scheme": "data.ddp", "model": "tiny", "dp": 2,
                                          "steps": 1, "timed_steps": 4, "warmup_steps": 1})
    t = case_row(case, pools(2)).time
    # the calling thread's CPU is a part of the process's
    assert t.own_cpu_s is not None and 0 < t.own_cpu_s <= t.cpu_s
    if LINUX:  # gloo's threads worked on the step's all-reduces
        assert any("gloo" in name and s > 0 for name, s in t.threads_cpu_s.items()), \
            t.threads_cpu_s


def _spin(seconds: float) -> float:
    """Busy the calling thread for ``seconds`` of its own CPU; returns what it spent."""
    t0 = thread_cpu.own_seconds()
    while thread_cpu.own_seconds() - t0 < seconds:
        pass
    return thread_cpu.own_seconds() - t0


@pytest.mark.skipif(not LINUX, reason="per-thread CPU is read from /proc (Linux only)")
def test_another_threads_cpu_is_counted_and_the_callers_is_not():
    spent, busy, release = {}, threading.Event(), threading.Event()

    def worker():
        spent["s"] = _spin(0.05)
        busy.set()
        release.wait()  # alive while the reading is taken

    before = thread_cpu.by_thread()
    t = threading.Thread(target=worker)
    t.start()
    busy.wait()
    after = thread_cpu.by_thread()
    release.set()
    t.join()
    other = thread_cpu.Counter()
    thread_cpu.add_delta(other, before, after)
    assert sum(other.values()) >= 0.9 * spent["s"]
    # the caller's own CPU is not among the others'
    before = thread_cpu.by_thread()
    mine = _spin(0.05)
    quiet = thread_cpu.Counter()
    thread_cpu.add_delta(quiet, before, thread_cpu.by_thread())
    assert sum(quiet.values()) < 0.5 * mine
