"""Shared fixtures: one persistent pool of local gloo ranks per world size per session."""
from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

from parbench.launch import close_shared_pools, shared_pool

settings.register_profile("ci", max_examples=12, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow,
                                                 HealthCheck.function_scoped_fixture])
settings.register_profile("thorough", max_examples=100, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow,
                                                 HealthCheck.function_scoped_fixture])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def pools():
    """``pools(world_size)`` -> a WorkerPool started once per session and reused."""
    yield lambda world_size: shared_pool(world_size)
    close_shared_pools()
