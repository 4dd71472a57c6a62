"""my_ddp's tests, with parbench's pytest plugin: the ``parbench_pool`` fixture keeps one pool
of local gloo ranks for the whole session, and ``parbench.testing``'s helpers run cases on it.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import given

from parbench.testing import (NotEquivalent, assert_bytes, assert_equivalent, cases,
                              rank_settings)

from my_ddp.buggy import BuggyDDP
from my_ddp.ddp import MyDDP


def test_my_ddp_equals_the_golden_run(parbench_pool):
    assert_equivalent(MyDDP, dp=2, model="tiny", steps=3)


def test_my_ddp_moves_the_bytes_of_ddp(parbench_pool):
    # MyDDP has no predict of its own: its traffic is held to the native DDP's closed form,
    # whose one bucket (the tiny model's gradients fit in bucket_mb=0.25) is one all-reduce
    # of every gradient, as MyDDP's flat buffer is
    assert_bytes(MyDDP, dp=2, model="tiny", bucket_mb=0.25)


@rank_settings(max_examples=4)
@given(case=cases(family="data", scheme=MyDDP))
def test_my_ddp_on_any_small_case(parbench_pool, case):
    assert_equivalent(MyDDP, case=case)


def test_the_bug_is_caught(parbench_pool):
    with pytest.raises(NotEquivalent) as caught:
        assert_equivalent(BuggyDDP, dp=2, model="tiny", steps=3)
    message = str(caught.value)
    assert "step 0" in message and "gradient" in message, message


def test_parbench_verify_catches_the_bug(tmp_path):
    """``parbench verify`` on the command line: exit status 3, the first failure named."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [here] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    proc = subprocess.run(
        [sys.executable, "-m", "parbench.cli", "verify", "scheme=my_ddp.buggy:BuggyDDP",
         "dp=2", "model=tiny", "steps=2", "timed_steps=0", f"out={tmp_path}"],
        env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out
    assert "NOT equivalent" in out and "first failure" in out and "gradient" in out, out
