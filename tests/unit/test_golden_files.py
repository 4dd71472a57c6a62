"""The committed golden files earn their place (issue 20, section 6): `parbench golden check`
is green on them under the verdict's noise rule, they are the suites' keys, and the suites'
golden runs are served from them. A failure here after a change to the model, the data, the
optimizer, a suite or torch says: re-record with `parbench golden record` (and commit golden/),
or -- when `golden check` fails -- find out first why the reference numbers moved."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from parbench import golden
from parbench.cli import main
from parbench.cli.inspect import golden_cases
from parbench.golden.select import group
from parbench.registry import get_scheme, routing_of

ROOT = Path(__file__).resolve().parents[2]
RECORD = "re-record with `parbench golden record` and commit golden/"


@pytest.fixture(scope="module")
def groups():
    """Every golden key of the suites' cases -> what it serves."""
    return group(golden_cases(), routing_of)


def test_golden_check_is_green_on_the_committed_files(capsys):
    code = main(["golden", "check", "--json"])
    rows = json.loads(capsys.readouterr().out)
    assert rows, "golden/ holds no golden file: " + RECORD
    failing = {r["name"]: r["worst"] or r["stale"] or r["new"] or "sha256"
               for r in rows if not r["ok"]}
    assert code == 0 and not failing, failing


def test_every_suite_has_its_main_key_stored_and_no_file_is_orphaned(groups):
    runs = golden.read_manifest(golden.GOLDEN_DIR)
    stored_keys = {e["key"] for e in runs.values()}
    suites = {c.split("/", 1)[0] for w in groups.values() for c in w.cases}
    missing = [s for s in suites if golden.main_key(s, groups) not in stored_keys]
    assert not missing, f"suites whose main golden key is not stored: {missing}; {RECORD}"
    orphans = [n for n, e in runs.items() if e["key"] not in groups]
    assert not orphans, f"golden files that serve no suite case: {orphans}; {RECORD}"


def test_the_suites_golden_runs_are_served_from_the_files(groups):
    """What the harness and the runner ask for (``Scheme.reference``) comes from the file:
    a row of such a case says ``golden_source: stored:<file>``."""
    runs = golden.read_manifest(golden.GOLDEN_DIR)
    for name, entry in runs.items():
        case = groups[entry["key"]].case
        run = get_scheme(case.run.scheme).reference(case, case.run.steps)
        assert run.source == f"stored:{entry['file']}", (name, run.source, RECORD)


def test_golden_check_is_green_on_another_cpu_kernel_path():
    """The files were recorded on one CPU; CI may run on another (AMD or Intel, AVX2 or
    AVX-512). torch's, MKL's and oneDNN's kernels for the oldest x86 path (no AVX) sum in
    another order: seen here up to 7.5e-5 in parameters (tolerance 1e-4) and 1.3e-7 in
    step-0 gradients (tolerance 2e-6) -- inside the verdict's rule, which the check uses."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default",
           "MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "ONEDNN_MAX_CPU_ISA": "SSE41",
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run([sys.executable, "-m", "parbench.cli", "golden", "check", "--json"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
                       check=False)
    rows = json.loads(p.stdout or "[]")
    failing = {r["name"]: r["worst"] for r in rows if not r["ok"]}
    assert p.returncode == 0 and rows and not failing, (failing, p.stderr[-2000:])
