"""Testing your own scheme with pytest: helpers, Hypothesis strategies and a pytest plugin.

Installing parbench registers the pytest plugin ``parbench.testing.plugin`` (entry point
``pytest11``), whose session fixture ``parbench_pool`` keeps one pool of local gloo ranks per
world size for the whole test session. The helpers below run on that pool::

    from hypothesis import given
    from parbench.testing import assert_bytes, assert_equivalent, cases, rank_settings

    from my_pkg.ddp import MyDDP

    def test_equivalent(parbench_pool):
        assert_equivalent(MyDDP, dp=2, model="tiny", steps=3)

    def test_bytes(parbench_pool):
        assert_bytes(MyDDP, dp=2, model="tiny")     # MyDDP.predict, or its family's native

    @rank_settings(max_examples=5)
    @given(case=cases(family="data", dp=2, scheme=MyDDP))
    def test_any_case(parbench_pool, case):
        assert_equivalent(MyDDP, case=case)

A case is given as keyword fields, the names of ``parbench run``'s ``key=value`` overrides
(``dp=2``, ``model="tiny"``, ``num_microbatches=2``, ``bucket_mb=0.01``, ...), or as a
``CaseConfig`` (``case=``, which the fields then change). The scheme is a ``Scheme`` subclass,
run by its import path ``"pkg.module:Class"`` (every rank imports it), or such a string.
Given no case at all, ``assert_equivalent(MyDDP)`` runs the family's default case set
(``default_set``; ``parbench.testing.defaults``: >= 2 micro-batches, 3 steps, shapes that
pad, an odd dp, tied embeddings, each declared option's values) -- the set ``parbench
verify`` runs with no case field and ``cases(family)`` draws from.

Failures are ``AssertionError``s with a readable message: ``NotEquivalent`` names the first
failing step, rank, check and tensor with its difference and tolerance, and prints the losses
beside the golden run's; ``BytesDiffer`` lists, per step, rank and mesh axis, the measured
bytes and calls beside the predicted ones. A rank that raises or hangs is ``SchemeCrashed``,
with the rank's traceback.

Nothing heavy is imported here until a helper is called (the plugin loads in every pytest
session of an environment with parbench installed).
"""
from .helpers import (DEFAULTS, BytesDiffer, NotEquivalent, SchemeCrashed, SchemeRun,
                      assert_bytes, assert_equivalent, default_set, make_case, native_scheme,
                      run_scheme, scheme_spec)
from .reports import _describe, _failed_check, _figure_diffs, bytes_report, equivalence_report
from .strategies import FAMILIES, cases, rank_settings

__all__ = ["assert_equivalent", "assert_bytes", "cases", "default_set", "rank_settings",
           "run_scheme",
           "make_case", "scheme_spec", "native_scheme", "SchemeRun", "NotEquivalent",
           "BytesDiffer", "SchemeCrashed", "FAMILIES", "DEFAULTS", "bytes_report",
           "equivalence_report", "_describe", "_failed_check", "_figure_diffs"]
