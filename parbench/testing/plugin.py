"""The pytest plugin of parbench (entry point ``pytest11``: loaded by every pytest session of
an environment where parbench is installed; disable it with ``-p no:parbench``).

Fixture:

- ``parbench_pool`` (session): ``parbench_pool(world_size)`` -> the session's persistent pool
  of local ranks of that size, started on first use and reused by every test, closed when the
  session ends. ``parbench.testing``'s helpers run on the same pools whether or not a test
  asks for the fixture; asking for it makes the pools' end explicit.

The pools are ``parbench.launch.shared_pool``'s, one per (world size, device) per process, so
a repository whose own ``conftest.py`` keeps pools the same way (parbench's ``pools``) shares
them: one set of rank processes per session.
"""
from __future__ import annotations

import sys

import pytest


@pytest.fixture(scope="session")
def parbench_pool():
    """``parbench_pool(world_size)`` -> a WorkerPool started once per session and reused."""
    from parbench.launch import close_shared_pools, shared_pool
    yield lambda world_size, device="cpu": shared_pool(world_size, device=device)
    close_shared_pools()


def pytest_sessionfinish(session, exitstatus):
    """End the rank processes the helpers started without the fixture (importing nothing if
    no pool was ever started)."""
    launch = sys.modules.get("parbench.launch")
    if launch is not None:
        launch.close_shared_pools()
