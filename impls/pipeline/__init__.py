"""Registers ``pipeline.<name>`` for every schedule of ``parbench.schedules.SCHEDULES``.

The pieces: ``scheme`` (the synchronous scheme: stages, replicas, figures), ``executor``
(the one executor), ``activations`` (held graphs and saved bytes, measured), ``weights``
(the weight-rule interface and the synchronous rule), ``split_backward`` (zero-bubble B/W
split), ``asynchronous`` (PipeDream and PipeDream-2BW, run continuously: their schemes;
rules in ``async_weights``, single-device runs in ``references``), ``prediction`` (the case
adapted to the closed forms of ``parbench.analytic.pipeline``) and ``metrics`` (bubble and
held-graph figures).
"""
from __future__ import annotations

from parbench.scheme import register
from parbench.schedules import SCHEDULES

from .asynchronous import PipeDreamScheme, TwoBWScheme
from .scheme import PipelineScheme
from .segments import SEGMENT_BASES

#: the asynchronous schedules' weight rules; every other schedule is synchronous
_ASYNC_BASES = {"pipedream": PipeDreamScheme, "2bw": TwoBWScheme}


def _register_all() -> dict[str, type]:
    out = {}
    for name, spec in SCHEDULES.items():
        if spec.asynchronous and name not in _ASYNC_BASES:
            raise TypeError(f"schedule {name!r} is asynchronous but has no weight rule here")
        base = _ASYNC_BASES.get(name) or SEGMENT_BASES.get(name, PipelineScheme)
        cls = type(f"Pipeline_{name.replace('-', '_')}", (base,), {
            "name": f"pipeline.{name}", "schedule_name": name,
            "description": spec.description, "__module__": __name__})
        out[name] = register(cls)
        globals()[cls.__name__] = cls  # picklable by reference
    return out


SCHEMES = _register_all()
