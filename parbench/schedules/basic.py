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

from .actions import BACKWARD_FULL, FORWARD, Action
from .closed_forms import (
    ClosedForm,
    all_microbatches_memory,
    gpipe_max_inflight,
    one_f_one_b_max_inflight,
    pipeline_flush_size,
    ptdp_bubble_fraction,
)
from .spec import ChunkRule, ExecutorKind, Placement, Rows, WeightRule, schedule_spec


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


@schedule_spec(
    "gpipe", description="GPipe (Huang et al. 2019): all forwards, then all backwards",
    chunks=ChunkRule.ONE, placement=Placement.LINEAR, can_split=True,
    closed_form=flush_closed_form, max_inflight=gpipe_max_inflight,
    memory=all_microbatches_memory,
    memory_note="activations of all m micro-batches on every rank (Huang et al. 2019)")
def gpipe(p: int, m: int, v: int) -> list[list[Action]]:
    """GPipe: every rank runs F0..F(m-1), then BW0..BW(m-1)."""
    return [[Action(FORWARD, i, r) for i in range(m)] +
            [Action(BACKWARD_FULL, i, r) for i in range(m)] for r in range(p)]


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
    chunks=ChunkRule.ONE, placement=Placement.LINEAR, can_split=True,
    closed_form=flush_closed_form, max_inflight=one_f_one_b_max_inflight,
    memory_note="activations of p - r micro-batches on rank r, p on the first "
                "(Narayanan et al. 2021, Sec. 2.2.1)")
def one_f_one_b(p: int, m: int, v: int) -> list[list[Action]]:
    """1F1B (PipeDream-Flush / DAPPLE), synchronous with a flush at the end."""
    return one_f_one_b_rows(p, m)


@schedule_spec(
    "pipedream",
    description="PipeDream (Narayanan et al. 2019): async 1F1B, weight stashing",
    chunks=ChunkRule.ONE, placement=Placement.LINEAR, can_split=True,
    weight_rule=WeightRule.PIPEDREAM, executor=ExecutorKind.ASYNCHRONOUS,
    closed_form=async_closed_form, max_inflight=one_f_one_b_max_inflight,
    memory_note="activations of p - r micro-batches and p - r stashed weight versions on "
                "rank r (Narayanan et al. 2019, Sec. 3.3)")
def pipedream(p: int, m: int, v: int) -> Rows:
    """PipeDream: 1F1B order, no flush, weight stashing (``asynchronous=True``)."""
    return Rows(one_f_one_b_rows(p, m),
                notes="asynchronous: weight stashing, no flush between iterations")


@schedule_spec(
    "2bw",
    description="PipeDream-2BW (Narayanan et al. 2021): double-buffered weights, 1-step delay",
    chunks=ChunkRule.ONE, placement=Placement.LINEAR, can_split=True,
    weight_rule=WeightRule.TWO_BW, executor=ExecutorKind.ASYNCHRONOUS,
    closed_form=async_closed_form, max_inflight=one_f_one_b_max_inflight,
    memory_note="activations of p - r micro-batches on rank r, two weight versions "
                "(Narayanan et al. 2021, Sec. 3.1)")
def pipedream_2bw(p: int, m: int, v: int) -> Rows:
    """PipeDream-2BW: 1F1B order, two weight versions, one-step-delayed update."""
    return Rows(one_f_one_b_rows(p, m), notes="asynchronous: W(t+1) = W(t) - lr * "
                                              "grad f(W(t-1)) (double-buffered weights)")
