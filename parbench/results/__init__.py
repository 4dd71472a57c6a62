"""Typed results, from the rank to the report: a step's check, a rank's result, a case's row.

``rank``: what one rank returns; ``row``: the row's groups; ``files``: results.jsonl;
``flat``: rows of the earlier, flat format.

A rank returns a ``RankResult`` (its ``StepCheck`` per checked step, its per-step figures and,
for a pipeline, its ``BubbleFigures``); ``runner.make_row`` merges the ranks into a ``Row``,
grouped as the report reads it:

- ``case``: ``RowCase`` (id, suite, scheme, family, baseline_of, the ``Layout``, the case);
- ``verdict``: ``Verdict`` (status, equivalence, largest errors, tolerances, ``FirstFailure``,
  the first diverging module: ``Divergence``);
- ``time``: ``Timing`` (median step, every rank's timed steps, tokens/s);
- ``memory``: ``Memory`` (peaks per rank, the predicted peak, ``ModelStates``);
- ``traffic``: ``Traffic`` (wire bytes and calls per rank and axis, measured beside predicted);
- ``pipeline``: ``BubbleFigures`` (pipeline schemes only);
- ``scheme_figures`` and ``analytic``: the two named mappings (``SchemeFigures``,
  ``AnalyticFigures``) of figures that only a report column or a reader of the JSON sees.

Units are bytes and seconds. One JSON object per finished (or failed) case is appended to
``results.jsonl`` and flushed as soon as the case ends; ``load_rows`` reads it back, and reads
files written before the groups existed (flat rows, ``results.flat``).
"""
from .files import append_row, decode_rows, load_rows, to_frame
from .rank import (BubbleDetail, BubbleFigures, Divergence, Failure, FirstFailure, RankResult,
                   SchemeFigures, StepCheck)
from .row import (ROW_FORMAT, AnalyticFigures, Environment, Memory, ModelStates, OpTally, Row,
                  RowCase, Timing, Tolerance, Traffic, Verdict)

__all__ = ["AnalyticFigures", "BubbleDetail", "BubbleFigures", "Divergence", "Environment",
           "Failure",
           "FirstFailure", "Memory", "ModelStates", "OpTally", "ROW_FORMAT", "RankResult", "Row",
           "RowCase", "SchemeFigures", "StepCheck", "Timing", "Tolerance", "Traffic", "Verdict",
           "append_row", "decode_rows", "load_rows", "to_frame"]
