"""``scripts/device_check.sh device=cpu``: the device check CI keeps working. One run of the
whole script (every step, on 1 and 2 gloo ranks), then its summary is read: every step ran,
every case passed, the files it promises exist, and nothing was written into
``results/devices/``. No bound on wall time (``tests/helpers.py``: a net against hangs only).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import SUBPROCESS_TIMEOUT_S

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "device_check.sh"
FAMILIES = {"data.ddp", "tensor.megatron", "context.ring-attention", "pipeline.1f1b",
            "expert.alltoall", "hybrid"}


def _env() -> dict:
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1")
    env.pop("PARBENCH_BACKEND", None)
    return env


@pytest.fixture(scope="module")
def check(tmp_path_factory):
    out = tmp_path_factory.mktemp("device-check") / "out"
    devices = sorted((ROOT / "results" / "devices").glob("*")) \
        if (ROOT / "results" / "devices").exists() else []
    proc = subprocess.run(["bash", str(SCRIPT), "device=cpu", f"out={out}"], cwd=ROOT,
                          env=_env(), capture_output=True, text=True,
                          timeout=SUBPROCESS_TIMEOUT_S)
    after = sorted((ROOT / "results" / "devices").glob("*")) \
        if (ROOT / "results" / "devices").exists() else []
    return proc, out, devices, after


def test_every_step_ran_and_passed(check):
    proc, out, _, _ = check
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] and summary["failures"] == []
    status = {s["name"]: s["status"] for s in summary["steps"]}
    assert status == {"preflight": "ok", "single": "ok", "multi": "ok", "calibrate": "ok",
                      "step": "ok", "estimate-calibrated": "ok",
                      "estimate-preset": "skipped"}  # no datasheet preset for a CPU
    assert "device check:" in proc.stdout and "wall" in proc.stdout


def test_every_family_ran_on_one_rank_and_two_ranks_ran(check):
    _, out, _, _ = check
    cases = json.loads((out / "summary.json").read_text())["cases"]
    single = {c["scheme"] for c in cases if c["part"] == "single" and c["world"] == 1}
    assert FAMILIES <= single and "zero.1" in single
    assert {c["world"] for c in cases if c["part"] == "multi"} == {2}
    assert all(c["passed"] for c in cases)
    assert all(c["golden"] for c in cases)  # each compared with a golden run


def test_prediction_beside_measurement(check):
    _, out, _, _ = check
    summary = json.loads((out / "summary.json").read_text())
    (row,) = summary["comparison"]
    assert row["prediction"] == "calibrated"
    assert row["predicted_s"] > 0 and row["measured_s"] > 0
    assert 0 < row["measured_mfu"] and 0 < row["predicted_mfu"]
    assert row["measured_peak_bytes"] > 0 and row["predicted_memory_bytes"] > 0
    text = (out / "summary.md").read_text()
    assert "| calibrated |" in text and "PASS" in text


def test_files_written_under_out_only(check):
    _, out, before, after = check
    for name in ("device.json", "steps.tsv", "summary.json", "summary.md", "step.json",
                 "estimate-calibrated.json", "single/results.jsonl", "multi/results.jsonl",
                 "logs/single.log", "logs/calibrate.log"):
        assert (out / name).is_file(), name
    info = json.loads((out / "device.json").read_text())
    profile = Path(info["profile_path"])
    assert profile.is_file() and out in profile.parents
    assert json.loads(profile.read_text())["calibrated"] is True
    assert before == after  # nothing written into results/devices/ on CPU


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    bad = subprocess.run(["bash", str(SCRIPT), "device=tpu"], cwd=ROOT, env=_env(),
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2
    assert bad.stderr.strip() == "device_check.sh: error: device='tpu' must be cpu or cuda"
    try:
        import torch
        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    out = tmp_path / "never"
    nocuda = subprocess.run(["bash", str(SCRIPT), "device=cuda", f"out={out}"], cwd=ROOT,
                            env=_env(), capture_output=True, text=True, timeout=120)
    assert nocuda.returncode == 2
    assert len(nocuda.stderr.strip().splitlines()) == 1
    assert "no CUDA device on this machine" in nocuda.stderr
    assert not out.exists()
