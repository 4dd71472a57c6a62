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
from parbench.schedules import SCHEDULES, ExecutorKind, ScheduleSpec, WeightRule

from .asynchronous import PipeDreamScheme, TwoBWScheme
from .bpipe import BPipeScheme
from .scheme import PipelineScheme
from .segments import SEGMENT_BASES

#: the scheme of each asynchronous weight rule (``ScheduleSpec.weight_rule``)
_ASYNC_BASES = {WeightRule.PIPEDREAM: PipeDreamScheme, WeightRule.TWO_BW: TwoBWScheme}


def _base(spec: ScheduleSpec) -> type:
    """The scheme class a schedule runs under, from its spec's executor kind."""
    if spec.executor is ExecutorKind.ASYNCHRONOUS:
        if spec.weight_rule not in _ASYNC_BASES:
            raise TypeError(f"schedule {spec.name!r} is asynchronous with weight rule "
                            f"{spec.weight_rule!r}, which no scheme here runs")
        return _ASYNC_BASES[spec.weight_rule]
    if spec.asynchronous:
        raise TypeError(f"schedule {spec.name!r} has weight rule {spec.weight_rule!r} but "
                        f"executor {spec.executor!r} (an asynchronous rule runs continuously)")
    if spec.executor is ExecutorKind.SEGMENTS:
        return SEGMENT_BASES[spec.name]
    return BPipeScheme if spec.executor is ExecutorKind.BPIPE else PipelineScheme


def _register_all() -> dict[str, type]:
    out = {}
    for name, spec in SCHEDULES.items():
        cls = type(f"Pipeline_{name.replace('-', '_')}", (_base(spec),), {
            "name": f"pipeline.{name}", "schedule_name": name,
            "description": spec.description, "__module__": __name__})
        out[name] = register(cls)
        globals()[cls.__name__] = cls  # picklable by reference
    return out


SCHEMES = _register_all()
