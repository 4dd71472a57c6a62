"""The commands that README.md and docs/ show, and the bad inputs (docs/commands.md), run as
a new user would (subprocesses); tests/unit/test_docs.py checks that the pages name real verbs,
suites and fields."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import SUBPROCESS_TIMEOUT_S
from parbench.results import load_rows

ROOT = Path(__file__).resolve().parents[2]


def parbench(*args, cwd=None, timeout=SUBPROCESS_TIMEOUT_S):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    t0 = time.time()
    p = subprocess.run([sys.executable, "-m", "parbench.cli", *args], cwd=cwd or ROOT,
                       capture_output=True, text=True, timeout=timeout, env=env)
    return p, time.time() - t0


#: ``python -m parbench.cli`` with one change: starting a worker process (every local rank
#: is a ``multiprocessing`` process, started by ``BaseProcess.start``) prints SPAWNED and exits
#: at once with SPAWN_EXIT. A run under it tells validation from the launcher by a fact -- no
#: rank was started -- where a clock would flake on a loaded machine.
SPAWNED, SPAWN_EXIT = "parbench-test: a worker process was started", 97
SPAWN_GUARD = f"""
import multiprocessing.process, os, sys
def _refuse(self):
    sys.stderr.write({SPAWNED!r} + "\\n")
    sys.stderr.flush()
    os._exit({SPAWN_EXIT})
multiprocessing.process.BaseProcess.start = _refuse
from parbench.cli import main
sys.exit(main(sys.argv[1:]))
"""


def parbench_without_ranks(*args, timeout=SUBPROCESS_TIMEOUT_S):
    """``parbench ARGS`` in a subprocess under SPAWN_GUARD."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", SPAWN_GUARD, *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.parametrize("args, message", [
    (["run", "suite=nosuch"], "suite='nosuch' does not exist"),
    (["run", "suite=smoke", "bogus=1"], "unknown key 'bogus'"),
    (["run", "suite=smoke", "tp=3", "hidden_size=32", "num_heads=8"],
     "tp=3 does not divide num_heads=8"),
    (["run", "suite=smoke", "world_size=3"], "world_size=3 does not match tp*cp*dp*pp"),
    (["run"], "run needs suite=NAME"),
    (["schedule", "chimera", "p=3", "m=6"], "p=3"),
])
def test_bad_input_fails_fast_with_one_line(args, message):
    """Fast means before any rank is spawned, shown by facts rather than a clock: exit status
    2 (the CLI's ConfigError path, cli/__init__.py) and no worker process started (the guard
    would have exited SPAWN_EXIT; test_the_spawn_guard_sees_a_rank_start shows it does)."""
    p = parbench_without_ranks(*args)
    assert SPAWNED not in p.stderr, p.stderr
    assert p.returncode == 2, (p.returncode, p.stderr)
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("parbench: error:"), p.stderr
    assert "Traceback" not in p.stderr
    assert message in err[0]


def test_the_spawn_guard_sees_a_rank_start(tmp_path):
    """The guard can fail the test above: a valid run gets past validation to its first
    worker process, and the guard stops it there."""
    p = parbench_without_ranks("run", "suite=smoke", f"out={tmp_path / 'out'}")
    assert p.returncode == SPAWN_EXIT and SPAWNED in p.stderr, (p.returncode, p.stderr)


def test_smoke_suite_runs_and_reports(tmp_path):
    out = tmp_path / "smoke"
    p, dt = parbench("run", "suite=smoke", f"out={out}")
    assert p.returncode == 0, p.stdout + p.stderr
    rows = load_rows(out)
    assert rows and all(r.verdict.equivalent for r in rows)
    assert {r.scheme for r in rows} >= {"data.ddp", "baseline.torch.ddp"}
    assert "ours/base" in p.stdout and "pass" in p.stdout
    assert (out / "report.md").exists() and (out / "figures" / "step_time.png").exists()
    for r in rows:
        assert Path(r.env.trace).exists()
    # re-rendering from the directory gives the same table
    p2, _ = parbench("report", str(out))
    assert p2.returncode == 0 and "data.ddp" in p2.stdout
    # resume skips finished cases
    p3, _ = parbench("run", "suite=smoke", f"out={out}", "resume=true")
    assert p3.returncode == 0
    assert len((out / "results.jsonl").read_text().splitlines()) == len(rows)


def test_crashed_and_hung_cases_are_failed_rows_and_the_suite_goes_on(tmp_path):
    """A rank that raises ends its case in seconds with its traceback; a rank that sleeps
    forever ends its case after hang_timeout_s with every rank's stack, naming the sleeper;
    both become failed rows, the next case still runs, and the exit status is 1.

    The crash ends its pool; a healthy zero.1 case then warms the fresh one (its ranks import
    the schemes while "building"), so the 5 s without progress that the hang detector counts
    start in the step, where rank 1 sleeps, and not in a build slowed down by a loaded
    machine (seen: both ranks still building after 5 s, rank 0 never reached the barrier)."""
    suite = tmp_path / "failing.yaml"
    suite.write_text("name: failing\ndefaults: {model: tiny, dp: 2, steps: 2}\ncases:\n"
                     "  - {scheme: data.ddp}\n"
                     "  - {scheme: data.ddp, fail_at_step: 1, fail_rank: 1}\n"
                     "  - {scheme: zero.1}\n"
                     "  - {scheme: zero.1, fail_at_step: 1, fail_rank: 1, fail_kind: hang,\n"
                     "     hang_timeout_s: 5}\n"
                     "  - {scheme: zero.2}\n")
    out = tmp_path / "out"
    p, _ = parbench("run", f"suite={suite}", f"out={out}", timeout=SUBPROCESS_TIMEOUT_S)
    assert p.returncode == 1, p.stderr
    assert "injected failure at step 1 on rank 1" in p.stderr and "Traceback" in p.stderr
    rows = load_rows(out)
    assert [r.scheme for r in rows] == ["data.ddp", "data.ddp", "zero.1", "zero.1", "zero.2"]
    assert all(rows[i].verdict.equivalent and rows[i].verdict.status == "ok" for i in (0, 2, 4))
    crashed, hung = rows[1].verdict, rows[3].verdict
    assert crashed.status == "failed" and crashed.failure.kind == "crashed"
    assert crashed.failure.rank == 1
    assert hung.status == "failed" and hung.failure.kind == "hung"
    assert hung.failure.rank == 1, hung.failure.message
    # ended by the hang detector at the case's hang_timeout_s (5 s), not by the default 60 s,
    # the collective timeout or the subprocess timeout: a fact where a clock would flake
    assert "no progress for 5 s" in hung.failure.message, hung.failure.message
    text = hung.failure.traceback
    assert "in _inject_failure" in text, text[:3000]  # rank 1's stack, from faulthandler
    assert "rank 0: barrier" in text, text[:3000]  # rank 0 waits in the step's barrier


def test_mesh_json_matches_megatron_order():
    p, _ = parbench("mesh", "tp=2", "pp=2", "dp=2", "--json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert d["groups"]["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert d["groups"]["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert d["groups"]["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_estimate_reproduces_zero_paper_example():
    p, _ = parbench("estimate", "params=7.5e9", "dp=64", "--json")
    assert p.returncode == 0, p.stderr
    gb = json.loads(p.stdout)["memory"]["model_states"]["zero_paper_gb"]
    # Rajbhandari et al. 2020, Table 1 / Fig. 1: 7.5B parameters, Nd = 64, K = 12
    assert gb == {"baseline": 120.0, "P_os": 31.4, "P_os+g": 16.6, "P_os+g+p": 1.88}


def test_traffic_table_flags_the_two_printing_errors():
    p, _ = parbench("traffic", "--json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    bad = [(c["parallelism"], c["column"]) for c in d["published_checks"] if not c["ok"]]
    assert len(bad) == 2 and bad[0][0] == "TP" and bad[1][0] == "PP", bad


def test_list_and_golden(tmp_path):
    p, _ = parbench("list", "--json")
    assert p.returncode == 0
    d = json.loads(p.stdout)
    assert "smoke" in d["suites"] and "data.ddp" in d["schemes"]
    g = tmp_path / "golden"
    p, _ = parbench("golden", "record", f"dir={g}", "suite=smoke")
    assert p.returncode == 0, p.stderr
    p, _ = parbench("golden", "check", f"dir={g}", "--json")
    assert p.returncode == 0 and json.loads(p.stdout)[0]["ok"]
    # a tampered golden file is caught
    f = next(g.glob("*.safetensors"))
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    p, _ = parbench("golden", "check", f"dir={g}", "--json")
    assert p.returncode != 0


def test_under_torchrun_each_process_is_one_rank(tmp_path):
    suite = tmp_path / "two.yaml"
    suite.write_text("name: two\ndefaults: {model: tiny, steps: 2}\ncases:\n"
                     "  - {scheme: data.ddp, dp: 2}\n  - {scheme: pipeline.1f1b, pp: 2, "
                     "num_microbatches: 2, micro_batch_size: 1}\n"
                     "  - {scheme: data.ddp, dp: 4}\n")  # world 4: left out, said once
    out = tmp_path / "out"
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                        "--standalone", "-m", "parbench.cli", "run", f"suite={suite}",
                        f"out={out}"], cwd=ROOT, capture_output=True, text=True,
                       timeout=SUBPROCESS_TIMEOUT_S, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = load_rows(out)
    assert [r.scheme for r in rows] == ["data.ddp", "pipeline.1f1b"]
    assert all(r.verdict.equivalent and r.traffic.wire_exact for r in rows)
    assert (out / "report.md").is_file()  # rank 0 writes the report, as a local run does
    assert p.stderr.count("leaving out 1 of world size 4") == 1, p.stderr


def test_under_torchrun_no_case_of_the_world_size_is_one_line_exit_2(tmp_path):
    env = {**os.environ, "WORLD_SIZE": "3", "RANK": "0"}
    env.pop("PARBENCH_POOL_WORKER", None)
    p = subprocess.run([sys.executable, "-m", "parbench.cli", "run", "suite=smoke",
                        f"out={tmp_path / 'out'}"], cwd=ROOT, capture_output=True, text=True,
                       timeout=SUBPROCESS_TIMEOUT_S, env=env)
    assert p.returncode == 2, p.stdout + p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "WORLD_SIZE=3" in p.stderr and "world sizes 2" in p.stderr, p.stderr


def test_compact_table_fits_100_columns_and_wide_keeps_every_column(tmp_path):
    """At 100 columns the smoke table has no wrapped rows; --wide shows every column."""
    out = tmp_path / "smoke"
    p, _ = parbench("run", "suite=smoke", f"out={out}")
    assert p.returncode == 0, p.stderr
    env = {"COLUMNS": "100"}
    narrow = subprocess.run([sys.executable, "-m", "parbench.cli", "report", str(out)],
                            cwd=ROOT, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S,
                            env={**os.environ, **env})
    lines = narrow.stdout.splitlines()
    assert narrow.returncode == 0 and lines
    assert max(len(line) for line in lines) <= 100
    rows = load_rows(out)
    # one table line per case: the lines between each table's rule and its caption are its
    # rows, none wrapped onto a second line
    body, inside = [], False
    for line in lines:
        if set(line.strip()) == {"─"}:
            inside = True
        elif inside and "bytes per rank" in line:
            inside = False
        elif inside:
            body.append(line)
    assert len(body) == len(rows), body
    wide = subprocess.run([sys.executable, "-m", "parbench.cli", "report", str(out), "--wide"],
                          cwd=ROOT, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S,
                          env={**os.environ, **env})
    assert wide.returncode == 0 and "update check" in wide.stdout and "tok/s" in wide.stdout


def test_bytes_off_the_closed_form_fail_the_run_with_status_3(tmp_path):
    """A native scheme whose numbers are right but whose traffic is not (a leftover
    debugging all-reduce) is reported equivalent, not exact, and the run exits 3."""
    suite = tmp_path / "bytes.yaml"
    suite.write_text("name: bytes\ndefaults: {model: tiny, dp: 2, steps: 2, timed_steps: 0}\n"
                     "cases:\n  - {scheme: mutant.ddp-debug-allreduce}\n")
    out = tmp_path / "out"
    p, _ = parbench("run", f"suite={suite}", f"out={out}", timeout=SUBPROCESS_TIMEOUT_S)
    assert p.returncode == 3, p.stdout + p.stderr
    (row,) = load_rows(out)
    assert row.verdict.equivalent and row.traffic.wire_exact is False
    assert row.traffic.calls_exact is False and not row.passed
