"""Hypothesis strategies of small valid cases per family (``parbench.testing.cases``) and
settings for property tests that run cases on ranks."""
from __future__ import annotations

from typing import Any

from ..config import ConfigError


# ---- Hypothesis ----------------------------------------------------------------------------------

#: per family: what ``cases`` draws (lists are sampled; the rest is fixed). Small sizes, the
#: degrees each family runs on 2 local ranks (hybrid: 4), every field from the public config.
FAMILIES: dict[str, dict[str, Any]] = {
    "data": {"model": "tiny", "dp": [1, 2], "micro_batch_size": [1, 2],
             "num_microbatches": [1, 2, 3], "bucket_mb": [0.01, 0.05, 0.25],
             "vocab_size": [61, 128], "seq_length": [8, 16], "tie_embeddings": [False, True],
             "weight_decay": [0.0, 0.01, 0.1]},
    "pipeline": {"model": "tiny-4l", "pp": 2, "micro_batch_size": [1, 2],
                 "num_microbatches": [2, 3, 4], "vocab_size": [61, 128],
                 "weight_decay": [0.0, 0.01]},
    "tensor": {"model": "tiny", "tp": 2, "vocab_size": [61, 128], "micro_batch_size": [1, 2],
               "num_microbatches": [1, 2], "seq_length": [8, 16]},
    "context": {"model": "tiny", "cp": 2, "seq_length": [8, 16, 32],
                "micro_batch_size": [1, 2], "num_microbatches": [1, 2]},
    "expert": {"model": "tiny", "dp": 2, "ep": [1, 2], "num_experts": [2, 4],
               "moe_top_k": [1, 2], "moe_capacity_factor": [0.0, 1.0, 1.5],
               "moe_every": [1, 2], "micro_batch_size": 2, "num_microbatches": [1, 2]},
    "hybrid": {"model": "tiny-4l", "vocab_size": 61, "micro_batch_size": 2,
               "num_microbatches": [2, 4],
               "layout": [{"tp": 2, "pp": 2}, {"tp": 2, "dp": 2}, {"cp": 2, "dp": 2},
                          {"dp": 2, "pp": 2}, {"tp": 2, "cp": 2}]},
}

#: every family's cases: few steps, nothing timed, a drawn seed
_COMMON = {"steps": 2, "timed_steps": 0, "seed": range(0, 2**16)}


def cases(family: str = "data", **fixed):
    """A Hypothesis strategy of valid ``CaseConfig``s of small sizes for ``family``.

    ``fixed`` sets fields (``dp=2``) or draws them from your own strategy
    (``bucket_mb=st.floats(0.001, 1)``); ``scheme=MyScheme`` (a class or spec) sets the
    case's scheme and keeps only the cases its ``check`` accepts (default: the family's
    native scheme, ``data.ddp``, ``pipeline.1f1b``, ...). Cases the config rules reject are
    never drawn. ``FAMILIES`` lists what each family draws."""
    from hypothesis import strategies as st

    from .helpers import _family_native, make_case
    if family not in FAMILIES:
        raise ValueError(f"family={family!r} is not one of {', '.join(FAMILIES)}")
    scheme = fixed.pop("scheme", None) or _family_native(family)
    space = {**_COMMON, **FAMILIES[family], **fixed}

    def as_strategy(v):
        if isinstance(v, st.SearchStrategy):
            return v
        if isinstance(v, range):
            return st.integers(v.start, v.stop - 1)
        if isinstance(v, list):
            return st.sampled_from(v)
        return st.just(v)

    @st.composite
    def draw_case(draw):
        from hypothesis import reject
        drawn = {k: draw(as_strategy(v)) for k, v in space.items()}
        drawn.update(drawn.pop("layout", None) or {})
        try:
            return make_case(scheme, **drawn)
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
