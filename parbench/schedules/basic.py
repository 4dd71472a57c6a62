"""One stage per rank: GPipe, 1F1B (PipeDream-Flush / DAPPLE), PipeDream, PipeDream-2BW.

* GPipe — Huang et al. 2019, "GPipe: Efficient Training of Giant Neural Networks
  using Pipeline Parallelism": all m forwards, then all m backwards; m
  micro-batches of activations in flight.
* 1F1B — Narayanan et al. 2021, "Memory-Efficient Pipeline-Parallel DNN Training"
  (PipeDream-Flush) and Fan et al. 2021 (DAPPLE): rank r runs ``p-1-r`` warm-up
  forwards, then alternates one forward and one backward, then drains the
  remaining backwards; at most ``p - r`` micro-batches in flight on rank r.
* PipeDream — Narayanan et al. 2019, "PipeDream: Generalized Pipeline Parallelism
  for DNN Training": the same 1F1B order without a flush, with weight stashing;
  successive iterations overlap, so the per-iteration fill/drain is amortised.
* PipeDream-2BW — Narayanan et al. 2021 (same memory-efficient paper): 1F1B order,
  double-buffered weights, update ``W(t+1) = W(t) - lr * grad f(W(t-1))``.

The two asynchronous schedules carry the compute order of one iteration (m
micro-batches, from an empty pipeline) and ``asynchronous=True``; ``continuous`` runs
the same order over a whole run without flushes, and the executor's weight rules
supply the stale-weight semantics.  With fused backward by default; ``split_backward=True`` emits ``B``
immediately followed by ``W`` instead of ``BW`` (same order, for executors that
always split).
"""
from __future__ import annotations

from dataclasses import replace

from ._arguments import need_positive, no_extra, resolve_v
from .actions import BACKWARD_FULL, FORWARD, Action, Schedule, linear_placement, split_fused
from .closed_forms import (
    ClosedForm,
    gpipe_max_inflight,
    one_f_one_b_max_inflight,
    pipeline_flush_size,
    ptdp_bubble_fraction,
)
from .spec import ChunkRule, Placement, schedule_spec


def flush_closed_form(p: int, m: int, v: int, tf: float, tb: float, tw: float,
                      overlap: bool) -> ClosedForm:
    """GPipe / 1F1B: idle (p-1)(T_F+T_B+T_W) per rank, ratio (p-1)/(m+p-1), exact for any
    uniform costs (Huang et al. 2019 §2.3; Narayanan et al. 2021 §2.2.1)."""
    return ClosedForm.of(
        m=m, v=v, tf=tf, tb=tb, tw=tw, bubble_size=pipeline_flush_size(p, tf, tb, tw),
        formula="(p-1)/(m+p-1)", source="Huang et al. 2019; Narayanan et al. 2021 §2.2.1",
        exact=True, conditions="uniform stage costs, p2p=0",
        ptdp_fraction=ptdp_bubble_fraction(p, m))


def async_closed_form(p: int, m: int, v: int, tf: float, tb: float, tw: float,
                      overlap: bool) -> ClosedForm:
    """PipeDream / 2BW: the generated schedule is one iteration started from an empty
    pipeline, whose bubble is 1F1B's. The papers' pipelines never flush (Narayanan et al.
    2019 §3; 2021 §3); parbench runs them continuously (``continuous``), where a steady
    step between two harness barriers pays only a forward ramp (``steady_closed_form``).
    """
    return replace(flush_closed_form(p, m, v, tf, tb, tw, overlap),
                   note="one iteration from an empty pipeline; run continuously, a steady "
                        "step idles (p-1)T_F per rank (continuous.steady_closed_form)")


def _finish(name: str, p: int, m: int, rows, split_backward: bool, *,
            asynchronous: bool = False, notes: str = "") -> Schedule:
    if split_backward:
        rows = [split_fused(row) for row in rows]
    return Schedule(
        name=name,
        p=p,
        m=m,
        v=1,
        num_stages=p,
        placement=linear_placement(p),
        mb_pipe=[0] * m,
        actions=rows,
        split_backward=bool(split_backward),
        asynchronous=asynchronous,
        notes=notes,
    )


@schedule_spec(
    "gpipe", description="GPipe (Huang et al. 2019): all forwards, then all backwards",
    chunks=ChunkRule.ONE, placement=Placement.LINEAR, closed_form=flush_closed_form,
    max_inflight=gpipe_max_inflight)
def gpipe(p: int, m: int, v: int | None = None, split_backward: bool = False, **kw) -> Schedule:
    """GPipe: every rank runs F0..F(m-1), then BW0..BW(m-1)."""
    need_positive("gpipe", p=p, m=m)
    resolve_v("gpipe", v, 1, allowed=(1,))
    no_extra("gpipe", kw)
    rows = []
    for r in range(p):
        row = [Action(FORWARD, i, r) for i in range(m)]
        row += [Action(BACKWARD_FULL, i, r) for i in range(m)]
        rows.append(row)
    return _finish("gpipe", p, m, rows, split_backward)


def one_f_one_b_rows(p: int, m: int) -> list[list[Action]]:
    """Per-rank 1F1B order: warm-up ``min(p-1-r, m)`` forwards, steady F/BW pairs, drain."""
    rows = []
    for r in range(p):
        warm = min(p - 1 - r, m)
        row = [Action(FORWARD, i, r) for i in range(warm)]
        for k in range(m - warm):
            row.append(Action(FORWARD, warm + k, r))
            row.append(Action(BACKWARD_FULL, k, r))
        row += [Action(BACKWARD_FULL, k, r) for k in range(m - warm, m)]
        rows.append(row)
    return rows


@schedule_spec(
    "1f1b",
    description="1F1B / PipeDream-Flush (Narayanan et al. 2021), DAPPLE (Fan et al. 2021)",
    chunks=ChunkRule.ONE, placement=Placement.LINEAR, closed_form=flush_closed_form,
    max_inflight=one_f_one_b_max_inflight)
def one_f_one_b(p: int, m: int, v: int | None = None, split_backward: bool = False, **kw) -> Schedule:
    """1F1B (PipeDream-Flush / DAPPLE), synchronous with a flush at the end."""
    need_positive("1f1b", p=p, m=m)
    resolve_v("1f1b", v, 1, allowed=(1,))
    no_extra("1f1b", kw)
    return _finish("1f1b", p, m, one_f_one_b_rows(p, m), split_backward)


@schedule_spec(
    "pipedream",
    description="PipeDream (Narayanan et al. 2019): async 1F1B, weight stashing",
    chunks=ChunkRule.ONE, placement=Placement.LINEAR, asynchronous=True,
    closed_form=async_closed_form, max_inflight=one_f_one_b_max_inflight)
def pipedream(p: int, m: int, v: int | None = None, split_backward: bool = False, **kw) -> Schedule:
    """PipeDream: 1F1B order, no flush, weight stashing (``asynchronous=True``)."""
    need_positive("pipedream", p=p, m=m)
    resolve_v("pipedream", v, 1, allowed=(1,))
    no_extra("pipedream", kw)
    notes = "asynchronous: weight stashing, no flush between iterations"
    return _finish("pipedream", p, m, one_f_one_b_rows(p, m), split_backward,
                   asynchronous=True, notes=notes)


@schedule_spec(
    "2bw",
    description="PipeDream-2BW (Narayanan et al. 2021): double-buffered weights, 1-step delay",
    chunks=ChunkRule.ONE, placement=Placement.LINEAR, asynchronous=True,
    closed_form=async_closed_form, max_inflight=one_f_one_b_max_inflight)
def pipedream_2bw(p: int, m: int, v: int | None = None, split_backward: bool = False, **kw) -> Schedule:
    """PipeDream-2BW: 1F1B order, two weight versions, one-step-delayed update."""
    need_positive("2bw", p=p, m=m)
    resolve_v("2bw", v, 1, allowed=(1,))
    no_extra("2bw", kw)
    notes = "asynchronous: W(t+1) = W(t) - lr * grad f(W(t-1)) (double-buffered weights)"
    return _finish("2bw", p, m, one_f_one_b_rows(p, m), split_backward,
                   asynchronous=True, notes=notes)
