"""Hypothesis strategies of small valid cases per family (``parbench.testing.cases``), drawn
from each family's default case set, and settings for property tests that run cases on
ranks."""
from __future__ import annotations

from typing import Any

from ..config import ConfigError


# ---- Hypothesis ----------------------------------------------------------------------------------

#: per family: what ``cases`` varies (lists are sampled) on top of a case of the family's
#: default set (``parbench.testing.defaults``), keeping what the set covers (>= 2
#: micro-batches, >= 3 steps, odd shapes, odd dp, tied embeddings, the declared options'
#: values): the seed, the micro-batch size, an odd vocabulary, the weight decay.
FAMILIES: dict[str, dict[str, Any]] = {
    "data": {"micro_batch_size": [1, 2], "vocab_size": [61, 67],
             "weight_decay": [0.0, 0.01, 0.1]},
    "pipeline": {"micro_batch_size": [1, 2], "vocab_size": [61, 67],
                 "weight_decay": [0.0, 0.01]},
    "tensor": {"micro_batch_size": [1, 2], "vocab_size": [61, 67]},
    "context": {"micro_batch_size": [1, 2], "vocab_size": [61, 67]},
    "expert": {"vocab_size": [61, 67], "weight_decay": [0.0, 0.01]},
    "hybrid": {"vocab_size": [61, 67]},
}

#: every drawn case: one timed step after the checked ones, a drawn seed
_COMMON = {"timed_steps": 1, "seed": range(0, 2**16)}


def _as_strategy(v):
    from hypothesis import strategies as st
    if isinstance(v, st.SearchStrategy):
        return v
    if isinstance(v, range):
        return st.integers(v.start, v.stop - 1)
    if isinstance(v, list):
        return st.sampled_from(v)
    return st.just(v)


def cases(family: str = "data", **fixed):
    """A Hypothesis strategy of valid ``CaseConfig``s of small sizes for ``family``: a case
    of the family's default set (the one ``parbench verify`` and ``assert_equivalent`` run
    with no case field; ``parbench.testing.defaults``), with the scheme's declared options
    placed, then the family's variations (``FAMILIES``) and a drawn seed.

    ``fixed`` sets fields (``dp=2``) or draws them from your own strategy
    (``bucket_mb=st.floats(0.001, 1)``), over the default case's; ``scheme=MyScheme`` (a
    class or spec) sets the case's scheme, whose declared options are covered and whose
    ``check`` filters the draws (default: the family's native scheme, ``data.ddp``,
    ``pipeline.1f1b``, ...). Cases the config rules reject are never drawn."""
    from hypothesis import strategies as st

    from ..registry import get_scheme
    from .defaults import base_fields, default_cases, place_options
    from .helpers import _family_native, make_case, scheme_spec
    if family not in FAMILIES:
        raise ValueError(f"family={family!r} is not one of {', '.join(FAMILIES)}")
    scheme = fixed.pop("scheme", None) or _family_native(family)
    spec = scheme_spec(scheme)
    cls = get_scheme(spec)
    accepted, _ = default_cases(cls, spec, family)
    # the scheme may accept no default case until ``fixed`` changes them: draw the raw set
    raw = [{**c["fields"], **c["placed"]}
           for c in place_options(base_fields(family), tuple(cls.options))]
    space = {**_COMMON, **FAMILIES[family], **fixed}

    @st.composite
    def draw_case(draw):
        from hypothesis import reject
        drawn = {k: draw(_as_strategy(v)) for k, v in space.items()}
        try:
            if accepted:
                return make_case(scheme, case=draw(st.sampled_from(accepted)), **drawn)
            return make_case(scheme, **{**draw(st.sampled_from(raw)), **drawn})
        except ConfigError:
            reject()

    return draw_case()


def rank_settings(max_examples: int = 5, **kw):
    """Hypothesis settings for property tests that run cases on ranks: no deadline (a case
    takes seconds), few examples, the health checks that a slow or fixture-using test trips
    off. Use as a decorator above ``@given``."""
    from hypothesis import HealthCheck, settings
    suppress = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                HealthCheck.filter_too_much]
    return settings(max_examples=max_examples, deadline=None,
                    suppress_health_check=kw.pop("suppress_health_check", suppress), **kw)
