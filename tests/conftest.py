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


def run_on_pool(pools, case):
    """Run a case on the session pool for its world size; return (merged, per_rank)."""
    from parbench.harness import merge_ranks, run_case
    from parbench.golden import reference_run
    from parbench.scheme import get_scheme

    pool = pools(case.parallel.world_size)
    per_rank = pool.run(run_case, case.to_dict(), timeout_s=300)
    cls = get_scheme(case.run.scheme)
    names = sorted(cls.reference(case, 1).params[0])
    del reference_run
    return merge_ranks(per_rank, names), per_rank
