"""Bad input on every verb: exit 2 with one line naming field, value and rule, before anything
spawns, never a traceback. The fuzz runs the command line in-process, with the verbs that
would spawn ranks (``run``, ``selftest``) stopped after their checks."""
from __future__ import annotations

import multiprocessing.process

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parbench.cli import main

VALUES = ["nan", "inf", "-inf", "0", "-1", "-5", "1e400", "1e18", "2", "1.5", "abc", "",
          "true", "4", "0.5"]
KEYS = ["tp", "pp", "dp", "cp", "ep", "vpp", "sp", "steps", "lr", "bucket_mb", "rtol",
        "timeout_s", "hang_timeout_s", "micro_batch_size", "num_microbatches", "hidden_size",
        "num_heads", "num_layers", "vocab_size", "seq_length", "device_gb", "params", "p",
        "m", "v", "tf", "tb", "tw", "zero_stage", "seed", "bogus", "model", "dtype",
        "weight_decay", "beta1", "eps", "recompute", "num_experts", "local_sgd_period",
        "parallel.pp", "run.nothing", "tokens_per_rank", "seeds", "profile", "dir", "out"]
VERBS = ["run", "estimate", "traffic", "schedule", "mesh", "list", "report", "golden",
         "selftest", "nosuchverb"]


@pytest.mark.parametrize("argv, message", [
    (["run", "suite=smoke", "pp=inf"], "pp='inf' is not an integer"),
    (["run", "suite=smoke", "steps=1e400"], "steps='1e400' is not an integer"),
    (["run", "suite=smoke", "pp=nan"], "pp='nan' is not an integer"),
    (["run", "suite=smoke", "lr=nan"], "lr='nan' is not a number"),
    (["run", "suite=smoke", "bucket_mb=nan"], "bucket_mb='nan' is not a number"),
    (["run", "suite=smoke", "rtol=-1"], "rtol=-1.0 must be >= 0"),
    (["run", "suite=smoke", "timeout_s=-5"], "timeout_s=-5.0 must be > 0"),
    (["run", "suite=smoke", "micro_batch_size=-2"], "micro_batch_size=-2 must be >= 1"),
    (["run", "suite=data", "sp=true"], "sp=true is not used by any case of suite data"),
    (["estimate", "tp=nan"], "tp='nan' is not an integer"),
    (["estimate", "hidden_size=-5"], "hidden_size=-5 must be >= 1"),
    (["estimate", "num_heads=7"], "num_heads=7 does not divide hidden_size=12288"),
    (["estimate", "params=7.5e9", "device_gb=0"], "device_gb=0 must be > 0"),
    (["estimate", "params=inf"], "params='inf' is not a number"),
    (["traffic", "tp=0"], "tp=0 must be > 0"),
    (["schedule", "1f1b", "p=0"], "p=0 must be >= 1"),
    (["schedule", "1f1b", "tf=nan"], "tf='nan' is not a number"),
    (["mesh", "tp=nan"], "tp='nan' is not an integer"),
    (["mesh", "tp=-2"], "tp=-2 must be >= 1"),
    (["mesh", "tp=1e18"], "exceeds 4096"),
    (["schedule", "1f1b", "p=1e18"], "exceeds 262144"),
    (["schedule", "1f1b", "p=2", "m=1e6"], "exceeds 262144"),
    (["run", "suite=smoke", "seed=-1"], "seed=-1 must be in [0, 2^31)"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("parbench: error:"), err
    assert message in err[0], err[0]


@pytest.fixture
def no_spawn(monkeypatch, tmp_path):
    """Stop ``run`` and ``selftest`` before they spawn ranks, and ``golden check`` before it
    retrains every stored golden run (tests/unit/test_golden.py checks that); work in a
    scratch directory. Returns the list of those stops reached (a verb that got past its
    checks), and fails the test if any worker process is started at all."""
    import parbench.golden
    import parbench.runner
    import parbench.mutation
    reached: list[str] = []
    monkeypatch.setattr(parbench.golden, "check", lambda *a, **k: [])
    def no_cases(suite, cases, out_dir, **kw):
        reached.append("run_cases")
        out_dir.mkdir(parents=True, exist_ok=True)
        return []
    def no_selftest(*a, **k):
        reached.append("run_selftest")
        return {"mutants": 0, "killed": 0, "false_alarms": 0, "controls": 0, "seeds": 1,
                "cases": []}
    def no_process(self):
        pytest.fail(f"a worker process was started: {self!r}")
    monkeypatch.setattr(parbench.runner, "run_cases", no_cases)
    monkeypatch.setattr(parbench.mutation, "run_selftest", no_selftest)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", no_process)
    monkeypatch.chdir(tmp_path)
    return reached


arguments = st.lists(st.tuples(st.sampled_from(KEYS), st.sampled_from(VALUES)), max_size=4)


@settings(max_examples=200, deadline=None)
@given(verb=st.sampled_from(VERBS), args=arguments,
       suite=st.sampled_from(["suite=smoke", "suite=data", "suite=pipeline", "suite=nosuch",
                              ""]),
       name=st.sampled_from(["1f1b", "zbv", "interleaved", "nosuch", "p=2"]))
def test_fuzzed_command_lines_exit_0_or_2_with_one_line(no_spawn, capsys, verb, args, suite,
                                                        name):
    argv = [verb] + [f"{k}={v}" for k, v in args]
    if verb == "run" and suite:
        argv.insert(1, suite)
    if verb == "schedule":
        argv.insert(1, name)
    if verb == "golden":
        argv.insert(1, "check")
    no_spawn.clear()  # one fixture for every example
    code = main(argv)
    err = capsys.readouterr().err
    assert code in (0, 2), (argv, code, err[-2000:])
    assert "Traceback" not in err, (argv, err[-2000:])
    if code == 2:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("parbench: error:"), (argv, err)
        # fails fast: rejected by the checks, before the runner or the selftest was reached
        # (a fact, where a clock would flake on a loaded machine)
        assert not no_spawn, (argv, no_spawn, err)
