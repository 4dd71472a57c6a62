"""``parbench verify`` names the figure that leaves the closed form: a user's scheme whose
numbers are right but which keeps a full parameter copy (in a closure) is reported with its
model states differing, rank and category named, and not as "bytes differ" (issue 20,
sec. 8)."""
from __future__ import annotations

from pathlib import Path

SCHEMES = Path(__file__).parents[1] / "equivalence" / "leaky_schemes.py"


def test_verify_says_the_model_states_differ_not_the_bytes(in_process_verify, tmp_path):
    r = in_process_verify(tmp_path, f"scheme={SCHEMES}:InClosure", "dp=2", "steps=2",
                          "timed_steps=0", f"out={tmp_path / 'r'}")
    assert r.returncode == 3, r.stdout + r.stderr
    lines = [x for x in r.stdout.splitlines() if "differ" in x]
    assert lines and "model states differ" in lines[-1], r.stdout
    assert "bytes differ" not in r.stdout and "wire bytes" not in r.stdout, r.stdout
    assert "model states ≠ its own closed form (model states: rank 0 other: " in r.stdout, \
        r.stdout
    assert " measured, 0 predicted)" in r.stdout, r.stdout
