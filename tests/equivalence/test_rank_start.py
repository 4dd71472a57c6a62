"""Ranks forked from the fork server (``parbench.rank_start``) start as spawned ones did: with
the parent's environment and import path as they are when the pool starts (not as they were
when the server started), one compute thread, and spawn still chosen by PARBENCH_START."""
from __future__ import annotations

import os
import sys

from parbench import launch, rank_start


def _what_the_rank_sees(ctx):
    import torch
    return (os.environ.get("PARBENCH_TEST_MARK"), "/parbench-test-path" in sys.path,
            torch.get_num_threads(), os.getppid())


def test_a_rank_takes_the_parent_environment_of_the_pool_start(monkeypatch):
    with launch.WorkerPool(1, timeout_s=60) as pool:  # the fork server is running after this
        assert pool.run(_what_the_rank_sees)[0][:2] == (None, False)
    monkeypatch.setenv("PARBENCH_TEST_MARK", "after the server started")
    monkeypatch.setattr(sys, "path", sys.path + ["/parbench-test-path"])
    with launch.WorkerPool(2, timeout_s=60) as pool:
        seen = pool.run(_what_the_rank_sees)
    for mark, on_path, threads, parent in seen:
        assert (mark, on_path, threads) == ("after the server started", True, 1)
        if rank_start.context().get_start_method() == "forkserver":
            assert parent != os.getpid()  # forked by the server, not started by us


def test_the_start_method_is_chosen(monkeypatch):
    monkeypatch.setenv("PARBENCH_START", "spawn")
    assert rank_start.context().get_start_method() == "spawn"
    monkeypatch.setenv("PARBENCH_START", "no-such-method")
    assert rank_start.context().get_start_method() == "spawn"
    monkeypatch.setenv("PARBENCH_START", "fork")  # its ranks would hold their lifeline
    assert rank_start.context().get_start_method() == "spawn"
    monkeypatch.delenv("PARBENCH_START")
    if sys.platform.startswith("linux"):
        assert rank_start.context().get_start_method() == "forkserver"
