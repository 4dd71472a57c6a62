"""A driver that dies leaves no process behind (``parbench.terminate``, the ranks' lifeline in
``parbench.launch``): ``parbench run`` ended by SIGTERM closes its ranks and exits with 143,
keeping the rows of the cases that finished; killed by SIGKILL (no handler runs), its ranks,
the fork server and the resource tracker go by themselves. The deadlines are hang checks, not
timings: without the clean-up the ranks stay blocked for good."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from parbench.results import load_rows

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"),
                                reason="finds the driver's processes through /proc (Linux)")

#: how long the driver may take to start its ranks (import torch twice, run a short case) on
#: a loaded 2-core machine: a net against a hang
START_S = 300.0
#: how long the processes may take to go after the signal: a hang check, not a timing
GONE_S = 60.0
#: the long case's timed steps: still running when the signal comes (a step takes
#: milliseconds or more)
LONG_STEPS = 2000


def _stat(pid: int) -> tuple[int, str, int] | None:
    """(parent pid, state, start time) of ``pid`` from /proc, None if there is none."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return int(fields[1]), fields[0], int(fields[19])


def _descendants(root: int) -> dict[int, int]:
    """Every live process under ``root``: pid -> its start time (a reused pid is not it)."""
    stats = {int(p): _stat(int(p)) for p in os.listdir("/proc") if p.isdigit()}
    found, todo = {}, [root]
    while todo:
        parent = todo.pop()
        for pid, st in stats.items():
            if st and st[0] == parent and st[1] != "Z" and pid not in found:
                found[pid] = st[2]
                todo.append(pid)
    return found


def _alive(procs: dict[int, int]) -> list[int]:
    """The processes of ``procs`` still running (a zombie has ended)."""
    out = []
    for pid, start in procs.items():
        st = _stat(pid)
        if st and st[1] != "Z" and st[2] == start:
            out.append(pid)
    return out


def _start(tmp_path: Path, *args: str) -> subprocess.Popen:
    """``parbench run out=TMP ARGS``, its ranks forked from the fork server (the default);
    its output in files (the ranks share its stderr: a pipe would wait for them)."""
    env = dict(os.environ)
    env.pop("PARBENCH_START", None)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    with open(tmp_path / "stdout", "w") as out, open(tmp_path / "stderr", "w") as err:
        return subprocess.Popen([sys.executable, "-m", "parbench.cli", "run",
                                 f"out={tmp_path / 'out'}", *args], cwd=ROOT, env=env,
                                stdout=out, stderr=err)


def _output(tmp_path: Path) -> str:
    return (tmp_path / "stdout").read_text() + (tmp_path / "stderr").read_text()


def _wait_for(driver: subprocess.Popen, ready, what: str, tmp_path: Path) -> None:
    deadline = time.time() + START_S
    while not ready():
        if driver.poll() is not None:
            pytest.fail(f"the driver ended (status {driver.returncode}) before {what}:\n"
                        f"{_output(tmp_path)}")
        assert time.time() < deadline, f"no {what} within {START_S:g} s"
        time.sleep(0.2)


def _ranks_running(driver: subprocess.Popen, world: int) -> bool:
    """``world`` rank processes under the driver (children of its fork server)."""
    tree = _descendants(driver.pid)
    return sum(1 for pid in tree if (_stat(pid) or (0,))[0] != driver.pid) >= world


def _assert_all_gone(procs: dict[int, int]) -> None:
    deadline = time.time() + GONE_S
    while _alive(procs) and time.time() < deadline:
        time.sleep(0.2)
    left = _alive(procs)
    assert not left, (f"{len(left)} of the driver's {len(procs)} processes still run "
                      f"{GONE_S:g} s after it went: {left}")


def test_sigterm_closes_the_ranks_and_keeps_finished_rows(tmp_path):
    """A short case, then a long one on the same ranks; SIGTERM once the first row is on
    disk: exit 143, every process the driver started is gone, the finished row is kept."""
    suite = tmp_path / "two.yaml"
    suite.write_text("defaults: {scheme: tensor.megatron, model: tiny, tp: 2}\ncases:\n"
                     "  - {steps: 1, warmup_steps: 0, timed_steps: 1}\n"
                     f"  - {{timed_steps: {LONG_STEPS}}}\n")
    results = tmp_path / "out" / "results.jsonl"
    driver = _start(tmp_path, f"suite={suite}")
    try:
        _wait_for(driver, lambda: results.exists() and results.read_text().endswith("\n"),
                  "the first case's row", tmp_path)
        procs = _descendants(driver.pid)
        assert len(procs) >= 4, procs  # the resource tracker, the fork server, two ranks
        driver.send_signal(signal.SIGTERM)
        driver.wait(timeout=GONE_S)
    finally:
        driver.kill()
    assert driver.returncode == 128 + signal.SIGTERM, _output(tmp_path)
    assert "terminated by SIGTERM; finished results are kept" in _output(tmp_path)
    _assert_all_gone(procs)
    rows = load_rows(results)
    assert len(rows) == 1 and rows[0].passed


def test_sigkill_leaves_no_rank(tmp_path):
    """SIGKILL runs no handler: the ranks see their lifeline end and exit; the fork server
    and the resource tracker follow."""
    driver = _start(tmp_path, "scheme=tensor.megatron", "model=tiny", "tp=2",
                    f"timed_steps={LONG_STEPS}")
    try:
        _wait_for(driver, lambda: _ranks_running(driver, 2), "two rank processes", tmp_path)
        procs = _descendants(driver.pid)
        assert len(procs) >= 4, procs  # the resource tracker, the fork server, two ranks
        driver.kill()
        driver.wait(timeout=GONE_S)
    finally:
        driver.kill()
    assert driver.returncode == -signal.SIGKILL
    _assert_all_gone(procs)
