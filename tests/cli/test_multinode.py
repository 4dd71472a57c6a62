"""Two torchrun "nodes" on this machine, as on a cluster: one job of 4 ranks, 2 per node.

Each node is its own ``torchrun --nnodes 2 --nproc-per-node 2 --node-rank N`` process
(static rendezvous on 127.0.0.1), exactly as ``scripts/slurm/parbench.sbatch`` starts one per
node. Global rank 0 gathers every rank's records and writes the rows; the rows must carry
all 4 ranks' data.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from parbench.worker import free_port
from parbench.results import load_rows
from tests.helpers import SUBPROCESS_TIMEOUT_S

ROOT = Path(__file__).resolve().parents[2]
NODES, PER_NODE = 2, 2
WORLD = NODES * PER_NODE
#: suite=smoke with dp=4: its data-parallel cases become world-4 cases (DDP, ZeRO-3 and
#: their torch baselines); the others (pp=2, tp=2, cp=2 times dp=4) are world 8 and are
#: left out under a world-4 torchrun job
RUN_ARGS = ["suite=smoke", f"dp={WORLD}"]
#: a hang fails the test instead of blocking it: the CLI tests' net (tests/helpers.py), not a
#: bound on wall time -- under two busy-loop processes the job took 206 s of the 240 s this
#: was, and a slower run was killed as "hung"
TIMEOUT_S = SUBPROCESS_TIMEOUT_S


def _expected_case_ids(monkeypatch) -> list[str]:
    """The cases ``parbench run`` keeps in a world-4 torchrun job (same code path)."""
    from parbench.cli.run import load_checked_suite
    monkeypatch.setenv("WORLD_SIZE", str(WORLD))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("PARBENCH_POOL_WORKER", raising=False)
    suite, _ = load_checked_suite(list(RUN_ARGS))
    return [c.id for c in suite.cases]


def _start_nodes(out: Path, logs: Path) -> list[tuple[subprocess.Popen, Path]]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                        "PARBENCH_POOL_WORKER")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    port = free_port()
    procs = []
    for node in range(NODES):
        log = logs / f"node{node}.log"
        cmd = [sys.executable, "-m", "torch.distributed.run",
               "--nnodes", str(NODES), "--nproc-per-node", str(PER_NODE),
               "--node-rank", str(node), "--master-addr", "127.0.0.1",
               "--master-port", str(port),
               "-m", "parbench.cli", "run", *RUN_ARGS, f"out={out}"]
        with open(log, "w") as fh:  # a file, not a pipe: a full pipe cannot stall a node
            p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        procs.append((p, log))
    return procs


def _wait(procs, timeout_s: float) -> bool:
    """Wait for every node; on a timeout or a failed node, kill every node's process group.
    Returns whether the deadline ran out with a node still running (a hang)."""
    deadline = time.time() + timeout_s
    hung = False
    try:
        while any(p.poll() is None for p, _ in procs):
            failed = [p for p, _ in procs if p.poll() not in (None, 0)]
            hung = time.time() > deadline
            if failed or hung:
                break
            time.sleep(0.2)
    finally:
        if any(p.poll() is None for p, _ in procs):
            # a node failed (its peer would wait out the rendezvous timeout) or the job hung
            time.sleep(2)  # let a failing node's torchrun finish its own report first
            for p, _ in procs:
                if p.poll() is None:
                    try:
                        os.killpg(p.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            for p, _ in procs:
                p.wait(10)
    return hung


def test_two_torchrun_nodes_make_one_job_and_rank0_writes_every_ranks_records(
        tmp_path, monkeypatch):
    expected = _expected_case_ids(monkeypatch)
    assert expected, "suite=smoke dp=4 has no world-4 case"
    out = tmp_path / "out"
    procs = _start_nodes(out, tmp_path)
    hung = _wait(procs, TIMEOUT_S)
    logs = {n: log.read_text() for n, (_, log) in enumerate(procs)}
    both = "\n".join(f"--- node {n} (exit {p.returncode}):\n{logs[n]}"
                     for n, (p, _) in enumerate(procs))
    # whether the guard killed a hung job (a fact), not a wall time compared after the fact
    assert not hung, f"hung: killed after {TIMEOUT_S} s\n{both}"
    assert [p.returncode for p, _ in procs] == [0] * NODES, both

    rows = load_rows(out)
    assert [r.id for r in rows] == expected, both
    # global rank 0 (node 0) reports and writes; node 1's ranks only take part
    for case_id in expected:
        assert f"{case_id}: pass" in logs[0], both
        assert case_id not in logs[1], both
    for r in rows:
        v, t, states = r.verdict, r.traffic, r.memory.states
        assert v.status == "ok" and v.failure is None, v.failure
        assert v.equivalent and v.golden_ok and v.update_ok, r.id
        assert r.case.world_size == WORLD and r.case.layout.dp == WORLD, r.id
        # every per-rank record reached rank 0: one entry per global rank
        per_rank = {"wire": t.wire, "calls": t.calls, "states": states.measured,
                    "peak": r.memory.peak_bytes, "step times": r.time.per_rank_s,
                    "wire predicted": t.wire_predicted, "calls predicted": t.calls_predicted,
                    "states predicted": states.predicted}
        for key, values in per_rank.items():
            if values is None and "predicted" in key:
                continue  # no closed form for this scheme (a baseline's)
            assert isinstance(values, list) and len(values) == WORLD, (r.id, key, values)
        # each rank's own ledger counted its data-parallel traffic
        assert all(sum(b.values()) > 0 for b in t.wire), r.id
        if r.case.baseline_of is None:  # a native scheme: bytes, calls, states in closed form
            assert r.exact, r.id
        # the trace holds the events of all 4 ranks, 2 from each node
        trace = json.loads(Path(r.env.trace).read_text())
        events = trace["traceEvents"] if isinstance(trace, dict) else trace
        assert {e.get("pid") for e in events} >= set(range(WORLD)), r.id
