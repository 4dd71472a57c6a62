"""Helpers for the tests (imported explicitly; fixtures live in conftest.py)."""
from __future__ import annotations

from parbench.config import CaseConfig
from parbench.results import RankResult
from parbench.runner import run_per_rank
from parbench.scheme import get_scheme
from parbench.verdict import Merged, merge_ranks


def run_on_pool(pools, case: CaseConfig) -> tuple[Merged, list[RankResult]]:
    """Run a case on the session pool for its world size; return (merged, per_rank)."""
    cls = get_scheme(case.run.scheme)
    pool = None if cls.isolated else pools(case.parallel.world_size)
    per_rank = run_per_rank(case, pool)
    names = sorted(cls.reference(case, 1).params[0])
    return merge_ranks(per_rank, names), per_rank
