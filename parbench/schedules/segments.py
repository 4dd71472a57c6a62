"""Pipelining at token-slice granularity: Seq1F1B and TeraPipe.

Both cut every micro-batch's sequence into k token slices (``segments=k``) and pipeline the
(micro-batch, slice) units; slice j's attention reads the cached K/V of slices < j on the
same stage, so within a stage the forwards run slice 0 first and the backwards slice k-1
first (the K/V gradients of later slices flow into earlier slices' backwards). A unit is a
virtual micro-batch ``u = mb * k + j`` (``Schedule.segments = k``, ``Schedule.m = m k``);
the slice dependencies are ``Schedule.segment_dependencies`` (validator) and
``segment_deps`` (simulator).

* Seq1F1B -- Sun et al. 2024, "Seq1F1B: Efficient Sequence-Level Pipeline Parallelism for
  Large Language Model Training" (arXiv 2406.03488), Sec. 3: 1F1B over the units, the
  backward queue ordered per micro-batch last slice first (the paper's partially ordered
  queue). Rank r warms up with ``p-1-r + k-1`` forwards (1F1B's p-1-r, plus the k-1 slices
  the last stage must run before the backward of a micro-batch's last slice; the
  authors' Megatron code, ``num_warmup_microbatches = p - r + splits - 2``), so at most
  ``p-r+k-1`` units -- ``(p-r+k-1)/k`` micro-batches of activations -- are in flight on rank
  r, against 1F1B's p-r (``seq1f1b_inflight``, ``seq1f1b_memory_ratio``).
* TeraPipe -- Li et al. 2021, "TeraPipe: Token-Level Pipeline Parallelism for Training
  Large-Scale Language Models" (ICML, arXiv 2102.07988), Sec. 3: GPipe over the
  units -- every forward, then the backwards, each micro-batch's slices in reverse; the
  slice lengths come from the paper's dynamic programme (Sec. 3.3, ``slicing``).

With unit costs per unit both bubbles are GPipe's / 1F1B's over M = m k units:
``(p-1)/(m k + p - 1)`` (the papers' point: the fill and drain shrink k-fold; Seq1F1B
Sec. 3 and Fig. 1, TeraPipe Sec. 3.3 ``(K-1) max t_i`` over the slices). Exact at uniform unit
costs, checked against the simulator in ``tests/unit/test_schedules_segments.py``.
"""
from __future__ import annotations

from .actions import BACKWARD_FULL, FORWARD, Action, ScheduleError
from .closed_forms import (
    ClosedForm,
    all_microbatches_memory,
    pipeline_flush_size,
    ptdp_bubble_fraction,
)
from .spec import ChunkRule, ExecutorKind, Placement, Rows, schedule_spec

#: why the time model does not price the token-slice schedules
_UNPRICED = ("the time model's layout has no token-slice count (seq_segments): with one "
             "slice per micro-batch it would price {}, and per-slice costs (attention grows "
             "with the context) are not modelled")


def _segments(name: str, segments) -> int:
    if not isinstance(segments, int) or isinstance(segments, bool) or segments < 1:
        raise ScheduleError(f"{name} needs a positive integer segments (token slices per "
                            f"micro-batch; got segments={segments!r})")
    return segments


def backward_order(m: int, k: int) -> list[int]:
    """The units in backward order: micro-batches in order, each one's slices last first."""
    return [mb * k + (k - 1 - j) for mb in range(m) for j in range(k)]


def seq1f1b_warmup(p: int, k: int, rank: int, m: int) -> int:
    """Forwards rank r runs before its first backward: ``p-1-r + k-1`` (capped at m k)."""
    return min(p - 1 - rank + k - 1, m * k)


def seq1f1b_inflight(p: int, m: int, k: int, rank: int) -> int:
    """Peak units in flight on rank r (forward done, backward not): warm-up + 1, capped."""
    return min(p - rank + k - 1, m * k)


def seq1f1b_memory_ratio(p: int, m: int, k: int, rank: int) -> float:
    """Peak activation memory of rank r under Seq1F1B over 1F1B's, each unit holding 1/k of
    a micro-batch's activations: ``min(p-r+k-1, m k) / (k min(p-r, m))``."""
    return seq1f1b_inflight(p, m, k, rank) / (k * min(p - rank, m))


def gpipe_inflight(p: int, m: int, k: int, rank: int) -> int:
    """TeraPipe (GPipe over units) holds all m k units before its first backward."""
    return m * k


def _units_closed_form(source: str):
    """The bubble over M = m k units (``m`` below is the schedule's unit count): idle
    (p-1)(T_F + T_B + T_W) per rank against M (T_F + T_B + T_W) of work, ratio
    (p-1)/(M + p - 1) -- exact when every unit costs the same on every stage."""
    def closed_form(p: int, m: int, v: int, tf: float, tb: float, tw: float,
                    overlap: bool) -> ClosedForm:
        return ClosedForm.of(
            m=m, v=v, tf=tf, tb=tb, tw=tw, bubble_size=pipeline_flush_size(p, tf, tb, tw),
            formula="(p-1)/(m k + p - 1) over m k (micro-batch, slice) units", source=source,
            exact=True, conditions="every unit and stage at the same costs (uniform slices, "
                                   "attention's growth with the context ignored), p2p=0",
            ptdp_fraction=ptdp_bubble_fraction(p, m))
    return closed_form


seq1f1b_closed_form = _units_closed_form(
    "Sun et al. 2024 (Seq1F1B) Sec. 3, Fig. 1; 1F1B's (p-1)/(m+p-1) over the units")
terapipe_closed_form = _units_closed_form(
    "Li et al. 2021 (TeraPipe) Sec. 3.3 latency at equal slice times; GPipe's over the units")


def _rows(k: int, rows: list[list[Action]]) -> Rows:
    return Rows(rows, segments=k, notes=f"{k} token slices per micro-batch; unit u = slice "
                                        f"u % {k} of micro-batch u // {k}")


@schedule_spec(
    "seq1f1b",
    description="Seq1F1B (Sun et al. 2024): 1F1B over (micro-batch, token slice) units, "
                "backwards last slice first",
    chunks=ChunkRule.ONE, placement=Placement.LINEAR, can_split=True,
    options=("segments",), executor=ExecutorKind.SEGMENTS, closed_form=seq1f1b_closed_form,
    unpriced=_UNPRICED.format("1F1B"),
    memory_note="(p-r+k-1)/(k (p-r)) of 1F1B's activations on rank r: p-r+k-1 units of 1/k "
                "micro-batch in flight (Sun et al. 2024, Sec. 3)")
def seq1f1b(p: int, m: int, v: int, segments: int = 1) -> Rows:
    """Seq1F1B over m micro-batches of ``segments`` slices (segments=1: 1F1B)."""
    k = _segments("seq1f1b", segments)
    order = backward_order(m, k)
    rows = []
    for r in range(p):
        warm = seq1f1b_warmup(p, k, r, m)
        row = [Action(FORWARD, u, r) for u in range(warm)]
        for i in range(m * k - warm):
            row.append(Action(FORWARD, warm + i, r))
            row.append(Action(BACKWARD_FULL, order[i], r))
        row += [Action(BACKWARD_FULL, u, r) for u in order[m * k - warm:]]
        rows.append(row)
    return _rows(k, rows)


@schedule_spec(
    "terapipe",
    description="TeraPipe (Li et al. 2021): GPipe over (micro-batch, token slice) units, "
                "slice lengths from a dynamic programme",
    chunks=ChunkRule.ONE, placement=Placement.LINEAR, can_split=True,
    options=("segments",), executor=ExecutorKind.SEGMENTS, closed_form=terapipe_closed_form,
    memory=all_microbatches_memory, unpriced=_UNPRICED.format("GPipe"),
    memory_note="activations of all m micro-batches, as GPipe over the token-slice units "
                "(Li et al. 2021, Sec. 3)")
def terapipe(p: int, m: int, v: int, segments: int = 1) -> Rows:
    """TeraPipe over m micro-batches of ``segments`` slices (segments=1: GPipe)."""
    k = _segments("terapipe", segments)
    order = backward_order(m, k)
    rows = [[Action(FORWARD, u, r) for u in range(m * k)] +
            [Action(BACKWARD_FULL, u, r) for u in order] for r in range(p)]
    return _rows(k, rows)


def segment_p2p(p: int, m: int, k: int, rank: int, *, b: int, s: int, h: int,
                bytes_per_element: int = 4) -> tuple[int, int]:
    """(wire bytes, send calls) of rank r in one step of Seq1F1B or TeraPipe, axis pp.

    Every unit crosses every stage boundary once forward (its activation, b l_j h elements)
    and once backward (that activation's gradient), one send each (Seq1F1B Sec. 3, the
    unit's activation is its slice's hidden states; TeraPipe Sec. 3). Rank r sends m k
    activations unless it is the last stage and m k gradients unless it is the first; the k
    slices of a micro-batch add up to its s tokens, so the bytes are 1F1B's, ``m b s h`` per
    direction, whatever the slicing, in k times as many calls.
    """
    directions = int(rank < p - 1) + int(rank > 0)
    return directions * m * b * s * h * bytes_per_element, directions * m * k
