"""Zero Bubble schedules — Qi, Wan, Huang & Lin 2024, "Zero Bubble Pipeline Parallelism"
(ICLR 2024, arXiv:2401.10241): the backward is split into B (gradient for the
input, on the critical path) and W (gradient for the weights, free to move).

* ZB-H1 (§2.1, Fig. 3 top): 1F1B order for F and B; rank i delays its W passes by
  i steps, so every rank keeps p micro-batches not yet fully backwarded (peak
  activation memory p·M_B as in 1F1B) and the delayed W's fill the drain.
  Bubble (Table 2): (p-1)(T_F + T_B - T_W).  In this simulator that is exact
  (makespan − work per rank) whenever T_W <= min(T_F, T_B).
* ZB-H2 (§2.2, Fig. 3 bottom): rank i warms up with 2(p-1-i)+1 forwards (peak
  (2p-1)·M_B on rank 0), runs B-W-F in the steady state, and over the last 2p-2
  steps drops W from the cycle (its last 2i forwards, then W's, fill one slot
  per step) so the B chain speeds up, keeping 2i+1 W's for the very end.  The
  timeline becomes a parallelogram: rank i is busy without a gap from its first
  forward to its last W.  Bubble (Table 2): (p-1)(T_F + T_B - 2T_W), which is the
  per-iteration bubble once iterations overlap (optimizer synchronisation
  bypassed, §4) — `SimResult.span_bubble` here.  Exact when T_W <= T_F and
  2T_W <= T_F + T_B.  Measured from a common start (parbench's bubble ratio) the
  first forward still needs (p-1)T_F to reach the last rank, so the idle time
  per rank is (p-1)·max(T_F, T_F + T_B - 2T_W) under the same conditions.
  Needs m >= 2p-1 (the warm-up of rank 0).
* ZB-V (§6): 2p stages in a V — rank r holds stages r and 2p-1-r — with peak
  activation memory of 1F1B and zero bubble when T_F = T_B = T_W.  Phases per
  rank: forwards of chunk 0, then chunk 1 forwards alternating with chunk 0, then
  chunk 1 F-B-W triples, then the steady state alternating F-B-W on both chunks,
  then the drain.  For m < 2p-1 the schedule is built for 2p-1 micro-batches and
  the actions of the missing ones are dropped (as torch.distributed.pipelining's
  ScheduleZBVZeroBubble does).
"""
from __future__ import annotations

from .actions import BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, Action
from .closed_forms import (
    ClosedForm,
    one_f_one_b_max_inflight,
    v_shape_memory,
    zb_h2_max_inflight,
    zb_h2_memory,
    zb_h2_size_from_start,
    zbv_span_bubble,
    zero_bubble_table2,
)
from .spec import ChunkRule, MinMicrobatches, Placement, schedule_spec

#: what Qi et al. 2024 state about memory, and how parbench's split backward differs
_ZB_NOTE = ("in units of M_B, one micro-batch's activations B needs; after B only the smaller "
            "M_W that W needs stays -- parbench's split backward keeps the whole graph until "
            "W, so its held graphs count forward to W, not the paper's forward to B")


def zb_h1_closed_form(p: int, m: int, v: int, tf: float, tb: float, tw: float,
                      overlap: bool) -> ClosedForm:
    """Qi et al. 2024 Table 2, ZB-H1 row: (p-1)(T_F+T_B-T_W)."""
    row = zero_bubble_table2(p, tf, tb, tw)["zb-h1"]
    return ClosedForm.of(
        m=m, v=v, tf=tf, tb=tb, tw=tw, bubble_size=row.bubble, formula="(p-1)(T_F+T_B-T_W)",
        source=row.source, exact=m >= p and tw <= min(tf, tb),
        conditions="m >= p, T_W <= min(T_F, T_B)")


def zb_h2_closed_form(p: int, m: int, v: int, tf: float, tb: float, tw: float,
                      overlap: bool) -> ClosedForm:
    """Qi et al. 2024 Table 2, ZB-H2 row (the parallelogram) and its size from a common
    start, (p-1)·max(T_F, T_F+T_B-2T_W)."""
    row = zero_bubble_table2(p, tf, tb, tw)["zb-h2"]
    return ClosedForm.of(
        m=m, v=v, tf=tf, tb=tb, tw=tw, bubble_size=zb_h2_size_from_start(p, tf, tb, tw),
        formula="(p-1)(T_F+T_B-2T_W) per parallelogram; (p-1)max(T_F, T_F+T_B-2T_W) from start",
        source=row.source, paper_bubble_size=row.bubble,
        exact=m >= 2 * p - 1 and tw <= tf and 2 * tw <= tf + tb,
        conditions="m >= 2p-1, T_W <= T_F, 2T_W <= T_F+T_B")


def zbv_closed_form(p: int, m: int, v: int, tf: float, tb: float, tw: float,
                    overlap: bool) -> ClosedForm:
    """Qi et al. 2024 §6: zero bubble per parallelogram when T_F = T_B = T_W; from a common
    start the (p-1)·T_F ramp remains."""
    equal = zbv_span_bubble(p, tf, tb, tw) == 0.0
    return ClosedForm.of(
        m=m, v=v, tf=tf, tb=tb, tw=tw, bubble_size=(p - 1) * tf if equal else None,
        formula="zero bubble per parallelogram when T_F=T_B=T_W", source="Qi et al. 2024 §6",
        paper_bubble_size=0.0 if equal else None, exact=equal and m >= 2 * p - 1,
        conditions="T_F = T_B = T_W, m >= 2p-1")


@schedule_spec(
    "zb-h1", description="ZB-H1 (Qi et al. 2024): split B/W, W passes delayed",
    chunks=ChunkRule.ONE, placement=Placement.LINEAR, splits_backward=True,
    closed_form=zb_h1_closed_form, max_inflight=one_f_one_b_max_inflight,
    memory_note="p M_B on the first rank, as 1F1B (Qi et al. 2024, Table 2); " + _ZB_NOTE)
def zb_h1(p: int, m: int, v: int) -> list[list[Action]]:
    """ZB-H1: 1F1B with the W passes of rank i delayed by i steps."""
    rows = []
    for i in range(p):
        warm = min(p - 1 - i, m)
        row = [Action(FORWARD, j, i) for j in range(warm)]
        done_w = 0
        for k in range(m):
            if warm + k < m:
                row.append(Action(FORWARD, warm + k, i))
            row.append(Action(BACKWARD_INPUT, k, i))
            if k >= i:  # the first i steps run without their W
                row.append(Action(BACKWARD_WEIGHT, done_w, i))
                done_w += 1
        row += [Action(BACKWARD_WEIGHT, j, i) for j in range(done_w, m)]
        rows.append(row)
    return rows


@schedule_spec(
    "zb-h2", description="ZB-H2 (Qi et al. 2024): extra warm-up forwards, parallelogram",
    chunks=ChunkRule.ONE, placement=Placement.LINEAR, splits_backward=True,
    min_m=MinMicrobatches(2, -1), closed_form=zb_h2_closed_form,
    max_inflight=zb_h2_max_inflight, memory=zb_h2_memory,
    memory_note="(2p-1) M_B on the first rank (Qi et al. 2024, Table 2); " + _ZB_NOTE)
def zb_h2(p: int, m: int, v: int) -> list[list[Action]]:
    """ZB-H2: extra warm-up forwards and a W-reordered tail (parallelogram)."""
    steady = m - 2 * p + 1  # B-W-F steps; the last 2p-2 steps carry one filler each
    rows = []
    for i in range(p):
        warm = 2 * (p - 1 - i) + 1
        row = [Action(FORWARD, j, i) for j in range(warm)]
        nxt = {"F": warm, "W": 0}

        def emit(kind: str) -> None:
            row.append(Action(kind, nxt[kind], i))
            nxt[kind] += 1

        for k in range(m - 1):
            row.append(Action(BACKWARD_INPUT, k, i))
            if k < steady:
                emit(BACKWARD_WEIGHT)
                emit(FORWARD)
            else:
                emit(FORWARD if k - steady < 2 * i else BACKWARD_WEIGHT)
        row.append(Action(BACKWARD_INPUT, m - 1, i))
        while nxt["W"] < m:  # 2i+1 trailing W's
            emit(BACKWARD_WEIGHT)
        rows.append(row)
    return rows


class _Counters:
    """Per-(kind, stage) micro-batch counters for phase-built schedules."""

    def __init__(self, row: list[Action], pipe_of_stage=None):
        self.row = row
        self.next: dict[tuple[str, int], int] = {}
        self.pipe_of_stage = pipe_of_stage or (lambda stage: 0)

    def emit(self, kind: str, stage: int, mb_offset: int = 0) -> Action:
        key = (kind, stage)
        mb = self.next.get(key, 0)
        self.next[key] = mb + 1
        action = Action(kind, mb + mb_offset, stage, self.pipe_of_stage(stage))
        self.row.append(action)
        return action

    def count(self, kind: str, stage: int) -> int:
        return self.next.get((kind, stage), 0)


@schedule_spec(
    "zbv", description="ZB-V (Qi et al. 2024): V placement, two stages per rank, split B/W",
    chunks=ChunkRule.TWO, placement=Placement.V, splits_backward=True,
    closed_form=zbv_closed_form, memory=v_shape_memory,
    memory_note="p M_B on the first rank, as 1F1B, in 2p chunks of half a rank's layers "
                "(Qi et al. 2024, Sec. 6); " + _ZB_NOTE)
def zbv(p: int, m: int, v: int) -> list[list[Action]]:
    """ZB-V: two chunks per rank in a V (rank r holds stages r and 2p-1-r)."""
    n = max(m, 2 * p - 1)  # build for at least 2p-1 micro-batches, drop the extra ones
    F, B, W = FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT
    rows = []
    for r in range(p):
        c0, c1 = r, 2 * p - 1 - r
        row: list[Action] = []
        ctr = _Counters(row)
        for _ in range(2 * (p - r) - 1):
            ctr.emit(F, c0)
        for _ in range(r):
            ctr.emit(F, c1)
            ctr.emit(F, c0)
        for _ in range(p - r):
            ctr.emit(F, c1)
            ctr.emit(B, c1)
            ctr.emit(W, c1)
        while ctr.count(F, c0) < n or ctr.count(F, c1) < ctr.count(F, c0):
            if ctr.count(F, c0) < n:
                ctr.emit(F, c0)
            ctr.emit(B, c0)
            ctr.emit(W, c0)
            ctr.emit(F, c1)
            ctr.emit(B, c1)
            ctr.emit(W, c1)
        for _ in range(r):
            ctr.emit(B, c0)
            ctr.emit(B, c1)
        for _ in range(p - r):
            ctr.emit(B, c0)
            ctr.emit(W, c0)
        while ctr.count(W, c1) < ctr.count(B, c1):
            ctr.emit(W, c1)
        while ctr.count(W, c0) < ctr.count(B, c0):
            ctr.emit(W, c0)
        rows.append([a for a in row if a.mb < m])
    return rows
