"""Commands run by the test process itself on the session's rank pools (issue 24).

``shared_rank_pools``: while a test runs, ``run_cases`` (``parbench run`` and ``verify``)
takes the process-wide pools (``runner.PoolCache(shared=True)``, the ``pools`` fixture's
ranks) instead of starting fresh ranks per command. ``in_process_verify``: ``parbench verify
ARGS`` run so -- the command's own code (argument parsing, its cases, ``run_cases``, the
localisation rerun, its printed lines and exit status), without an interpreter started to
import torch again and two fresh ranks. The installed script as a user runs it keeps its
own tests (``test_verify.py``, ``test_verify_defaults.py``, ``test_cli.py``)."""
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
def shared_rank_pools(pools, monkeypatch):
    """While the test runs, a command's ``run_cases`` runs on the session's pools."""
    from parbench import runner
    monkeypatch.setattr(runner, "PoolCache", functools.partial(runner.PoolCache, shared=True))
    return pools


@pytest.fixture
def in_process_verify(shared_rank_pools, capsys, monkeypatch):
    """``in_process_verify(cwd, *args)`` -> CliRun of ``parbench verify *args`` run in
    ``cwd``."""
    from parbench.cli import main

    def verify(cwd, *args) -> CliRun:
        monkeypatch.chdir(cwd)
        capsys.readouterr()
        code = main(["verify", *args])
        out, err = capsys.readouterr()
        return CliRun(code, out, err)
    return verify
