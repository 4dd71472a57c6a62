"""``in_process_verify``: ``parbench verify ARGS`` run by the test process itself on the
session's rank pools (issue 24). The command's own code runs -- argument parsing, its cases,
``run_cases``, the localisation rerun, its printed lines and exit status -- but ``run_cases``
takes the process-wide pools (``runner.PoolCache(shared=True)``, the ``pools`` fixture's
ranks) instead of starting two fresh ranks, and no interpreter is started to import torch
again. The installed script as a user runs it keeps its own tests (``test_verify.py``,
``test_verify_defaults.py``)."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest


@dataclass
class CliRun:
    """What ``subprocess.run(..., capture_output=True, text=True)`` gives the tests."""

    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def in_process_verify(pools, capsys, monkeypatch):
    """``in_process_verify(cwd, *args)`` -> CliRun of ``parbench verify *args`` run in
    ``cwd``."""
    from parbench import runner
    from parbench.cli import main
    monkeypatch.setattr(runner, "PoolCache", functools.partial(runner.PoolCache, shared=True))

    def verify(cwd, *args) -> CliRun:
        monkeypatch.chdir(cwd)
        capsys.readouterr()
        code = main(["verify", *args])
        out, err = capsys.readouterr()
        return CliRun(code, out, err)
    return verify
