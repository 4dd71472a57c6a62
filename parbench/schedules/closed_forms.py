"""Closed-form pipeline bubbles and in-flight limits from the papers.

Two ways of stating a bubble appear in the literature; both are provided:

* bubble *size*: idle time per rank per iteration, in the units of the per-op
  costs (Qi et al. 2024 Table 2; DeepSeek-V3 Table 2);
* bubble *fraction* relative to ideal time: ``t_pb / t_id`` (Narayanan et al.
  2021, PTD-P §2.2.1: ``(p-1)/m`` for 1F1B, §2.2.2: ``(p-1)/(v·m)`` interleaved).

parbench's bubble *ratio* is ``1 - sum(busy) / (p · makespan)``.  When every
rank does the same work ``w`` and idles ``size`` inside the makespan,
``ratio = size / (w + size)`` (:func:`ratio_from_size`), and a fraction f
relative to ideal becomes ``f / (1 + f)`` (:func:`ratio_from_fraction`); e.g.
1F1B: ``(p-1)/m  ->  (p-1)/(m+p-1)``.

Notation: p ranks, m micro-batches, v chunks per rank; T_F, T_B, T_W the costs
of a forward, a backward-for-inputs and a backward-for-weights of one stage
(a fused backward costs T_B + T_W).  Costs are uniform across stages and
point-to-point latency is zero.  Each formula's docstring says under which
conditions parbench's generators reproduce it exactly (checked in
tests/unit/test_schedules_closed_forms.py).

This module holds the papers' formulas and the :class:`ClosedForm` record.  Which formula
belongs to which schedule is stated once, next to the generator (its ``schedule_spec``'s
``closed_form``); ``registry.closed_form(schedule, ...)`` is the one dispatch.
"""
from __future__ import annotations

from dataclasses import dataclass


def ratio_from_size(size: float, work: float) -> float:
    """parbench bubble ratio from an idle time per rank and the work per rank.

    Every rank busy ``work`` and idle ``size`` in a makespan of ``work + size``
    gives ``1 - p·work / (p·(work + size)) = size / (work + size)``.
    """
    total = work + size
    return size / total if total > 0 else 0.0


def ratio_from_fraction(fraction: float) -> float:
    """parbench ratio from a bubble fraction relative to ideal time (PTD-P's t_pb/t_id)."""
    return fraction / (1.0 + fraction)


# -- GPipe / 1F1B / interleaved ---------------------------------------------
def gpipe_bubble_ratio(p: int, m: int) -> float:
    """(p-1)/(m+p-1): Huang et al. 2019 (GPipe) §2.3, bubble overhead O((K-1)/(M+K-1)).

    In parbench's definition with uniform stage costs this is exact for GPipe and
    1F1B alike, whatever T_F and T_B are (size (p-1)(T_F+T_B+T_W), work m(...)).
    """
    return (p - 1) / (m + p - 1)


def one_f_one_b_bubble_ratio(p: int, m: int) -> float:
    """1F1B has GPipe's bubble (Narayanan et al. 2021, PTD-P §2.2.1): (p-1)/(m+p-1)."""
    return gpipe_bubble_ratio(p, m)


def ptdp_bubble_fraction(p: int, m: int, v: int = 1) -> float:
    """PTD-P bubble time fraction t_pb/t_id = (1/v)·(p-1)/m.

    Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
    Clusters Using Megatron-LM", §2.2.1 (v = 1: (p-1)/m) and §2.2.2 (interleaved).
    This is relative to the *ideal* time, not parbench's ratio; see
    :func:`ratio_from_fraction`.
    """
    return (p - 1) / (v * m)


def interleaved_bubble_ratio(p: int, m: int, v: int) -> float:
    """parbench ratio of the interleaved schedule: (p-1)/(v·m + p-1).

    Derived from PTD-P §2.2.2 via :func:`ratio_from_fraction`.  Bubble size
    (p-1)(T_F + T_B + T_W) with per-chunk costs, work v·m(T_F+T_B+T_W).  The
    generator reproduces it exactly for every m >= p (Megatron requires m % p == 0;
    the relaxed grouping also hits it); looped BFS (Lamy-Poirier 2023) likewise.
    """
    return (p - 1) / (v * m + p - 1)


def pipeline_flush_size(p: int, tf: float, tb: float, tw: float = 0.0) -> float:
    """Idle time per rank of GPipe / 1F1B: (p-1)(T_F + T_B + T_W)."""
    return (p - 1) * (tf + tb + tw)


# -- Zero Bubble (Qi et al. 2024) ---------------------------------------------
@dataclass(frozen=True, kw_only=True)
class TableRow:
    """One row of a paper's comparison table."""

    schedule: str
    bubble: float          # idle time per rank (bubble size)
    memory: float          # peak activation memory, in the table's unit
    memory_unit: str
    params: float = 1.0    # parameter memory per rank relative to 1F1B
    source: str = ""


def zero_bubble_table2(p: int, tf: float, tb: float, tw: float) -> dict[str, TableRow]:
    """Qi et al. 2024, "Zero Bubble Pipeline Parallelism", Table 2.

    ========  ========================  ===========
    schedule  bubble size               peak memory
    ========  ========================  ===========
    1F1B      (p-1)(T_F + T_B + T_W)    p·M_B
    ZB-H1     (p-1)(T_F + T_B - T_W)    p·M_B
    ZB-H2     (p-1)(T_F + T_B - 2T_W)   (2p-1)·M_B
    ========  ========================  ===========

    M_B is the activation memory one micro-batch holds on one stage until its B.
    Reproduced here (peak memory as peak in-flight micro-batches on rank 0):
    1F1B always; ZB-H1 (makespan − work) when m >= p and T_W <= min(T_F, T_B);
    ZB-H2 as the parallelogram bubble `SimResult.span_bubble` when m >= 2p-1,
    T_W <= T_F and 2T_W <= T_F + T_B — its parbench size (common start) is then
    :func:`zb_h2_size_from_start`.
    """
    src = "Qi et al. 2024, Table 2"
    return {
        "1f1b": TableRow(schedule="1f1b", bubble=(p - 1) * (tf + tb + tw), memory=p,
                         memory_unit="M_B", source=src),
        "zb-h1": TableRow(schedule="zb-h1", bubble=(p - 1) * (tf + tb - tw), memory=p,
                          memory_unit="M_B", source=src),
        "zb-h2": TableRow(schedule="zb-h2", bubble=(p - 1) * (tf + tb - 2 * tw),
                          memory=2 * p - 1, memory_unit="M_B", source=src),
    }


def zb_h2_size_from_start(p: int, tf: float, tb: float, tw: float) -> float:
    """ZB-H2's idle time per rank measured from a common start: (p-1)·max(T_F, T_F+T_B-2T_W).

    Table 2's (p-1)(T_F+T_B-2T_W) counts the parallelogram only (iterations
    overlap once the optimizer synchronisation is bypassed, Qi et al. 2024 §4).
    A single iteration started together still pays the (p-1)·T_F ramp before the
    last rank gets its first micro-batch; the larger of the two is the idle time
    (derived here; exact under ZB-H2's conditions in `zero_bubble_table2`).
    """
    return (p - 1) * max(tf, tf + tb - 2 * tw)


def zbv_span_bubble(p: int, tf: float, tb: float, tw: float) -> float | None:
    """ZB-V (Qi et al. 2024, §6): zero bubble when T_F = T_B = T_W and m >= 2p-1.

    The paper claims zero bubble only for equal costs; returns 0.0 then and None
    otherwise.  Measured from a common start the idle time is the (p-1)·T_F ramp
    (one chunk's forward per rank), and the peak in-flight is 2p chunk
    activations per rank, i.e. 1F1B's p·M_B.
    """
    return 0.0 if tf == tb == tw else None


# -- DualPipe (DeepSeek-V3 technical report) -----------------------------------
def dualpipe_table2(pp: int, F: float, B: float, W: float, FB: float | None = None) -> dict[str, TableRow]:
    """DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", §3.2.1, Table 2.

    ========  ===========================  ==========  ==========
    method    bubble                       parameter   activation
    ========  ===========================  ==========  ==========
    1F1B      (PP-1)(F + B)                1×          PP
    ZB1P      (PP-1)(F + B - 2W)           1×          PP
    DualPipe  (PP/2-1)(F&B + B - 3W)       2×          PP + 1
    ========  ===========================  ==========  ==========

    F: forward chunk, B: *full* backward chunk, W: weight-backward chunk, F&B:
    two mutually overlapped forward and backward chunks (default F + B, i.e. no
    speed-up from overlap).  In Zero Bubble notation B = T_B + T_W and W = T_W, so
    the 1F1B and ZB1P rows equal Qi et al.'s 1F1B and ZB-H1 rows.
    Reproduced by `dualpipe` with ``simulate(..., overlap=True)`` (F&B pairs run as
    units) when T_F <= T_B and T_W <= T_B (T_B = B - W); for DualPipeV read PP as
    the number of stages 2p.  Activation PP+1 is the peak in-flight per rank.
    """
    fb = F + B if FB is None else FB
    src = "DeepSeek-V3 report, Table 2"
    return {
        "1f1b": TableRow(schedule="1f1b", bubble=(pp - 1) * (F + B), memory=pp,
                         memory_unit="micro-batches", source=src),
        "zb1p": TableRow(schedule="zb1p", bubble=(pp - 1) * (F + B - 2 * W), memory=pp,
                         memory_unit="micro-batches", source=src),
        "dualpipe": TableRow(schedule="dualpipe", bubble=(pp / 2 - 1) * (fb + B - 3 * W),
                             memory=pp + 1, memory_unit="micro-batches", params=2.0,
                             source=src),
    }


# -- Chimera (Li & Hoefler 2021) ------------------------------------------------
def chimera_bubble_ratio(D: int, N: int) -> float:
    """(D-2)/(2N+D-2): Li & Hoefler 2021, "Chimera", Table 2 (D stages, N micro-batches).

    Counts equal-length forward and backward slots: D-2 idle slots per worker
    against 2N busy ones.  Reproduced exactly when T_F equals the fused backward
    cost (N a multiple of D); activations in flight per worker range over
    [D/2+1, D] micro-batches for N = D (the paper's [(D/2+1)M_a, D·M_a]).
    """
    return (D - 2) / (2 * N + D - 2)


# -- in-flight limits -------------------------------------------------------------
def gpipe_max_inflight(p: int, m: int, rank: int) -> int:
    """GPipe: m micro-batches in flight (all forwards before any backward; Huang et al. 2019)."""
    return m


def one_f_one_b_max_inflight(p: int, m: int, rank: int) -> int:
    """1F1B / PipeDream-Flush: min(p - rank, m), at most p on rank 0 (Narayanan et al. 2021,
    §2.2.1); ZB-H1 keeps the same bound (Qi et al. 2024 Table 2, p·M_B)."""
    return min(p - rank, m)


def zb_h2_max_inflight(p: int, m: int, rank: int) -> int:
    """ZB-H2: min(2(p-1-rank)+1, m), (2p-1)·M_B on rank 0 (Qi et al. 2024 Table 2)."""
    return min(2 * (p - 1 - rank) + 1, m)


# -- activation memory: micro-batches' worth of a rank's layers held at the peak ----------
# ``memory(p, m, v, rank)``, the papers' rules in one unit: the activations of one
# micro-batch through all the layers a rank holds (l/p of them per replica). What the time
# model multiplies one micro-batch's activations by (``ScheduleSpec.memory``).
def flush_memory(p: int, m: int, v: int, rank: int) -> float:
    """1F1B and the schedules that keep its bound: min(p - rank, m) (Narayanan et al. 2021,
    Sec. 2.2.1; ZB-H1: Qi et al. 2024 Table 2, p M_B)."""
    return min(p - rank, m)


def all_microbatches_memory(p: int, m: int, v: int, rank: int) -> float:
    """GPipe, looped BFS, TeraPipe: every forward before any backward, m micro-batches."""
    return m


def interleaved_memory(p: int, m: int, v: int, rank: int) -> float:
    """Interleaved 1F1B: p micro-batches on the first rank, times 1 + (p-1)/(p v) for the
    warm-up's extra chunks (Korthikanti et al. 2022, Sec. 4.2.3); min(m, p) elsewhere."""
    held = min(m, p)
    return held * (1 + (p - 1) / (p * v)) if rank == 0 else held


def zb_h2_memory(p: int, m: int, v: int, rank: int) -> float:
    """ZB-H2: (2p-1) M_B on the first rank (Qi et al. 2024 Table 2)."""
    return zb_h2_max_inflight(p, m, rank)


def v_shape_memory(p: int, m: int, v: int, rank: int) -> float:
    """ZB-V: 1F1B's p M_B, as 2p chunk activations of half a rank's layers (Qi et al. 2024,
    Sec. 6); Hanayo's cap of v p chunk activations (Liu et al. 2023, Sec. 3) likewise."""
    return min(m, p)


def dualpipe_memory(p: int, m: int, v: int, rank: int) -> float:
    """DualPipe and DualPipeV: PP + 1 micro-batches of activations (DeepSeek-V3 report,
    Table 2; DeepSeek's DualPipe repository for the V variant)."""
    return min(m, p + 1)


# -- the record a schedule's closed form returns --------------------------------------
@dataclass(frozen=True, kw_only=True)
class ClosedForm:
    """A paper's bubble for one generated schedule at scalar costs, in parbench's terms.

    bubble_size: idle time per rank from a common start (None when the paper makes no claim
    for these costs); bubble_ratio: parbench's ratio (:func:`ratio_from_size`);
    exact: whether the generator reproduces it exactly under these conditions (checked in
    tests/unit/test_schedules_closed_forms.py); work_per_rank: m·v·(T_F+T_B+T_W);
    paper_bubble_size: the paper's own metric where it differs; ptdp_fraction: PTD-P's
    bubble over ideal time; note: free text.
    """

    formula: str
    source: str
    bubble_size: float | None
    exact: bool
    conditions: str
    work_per_rank: float
    bubble_ratio: float | None
    paper_bubble_size: float | None = None
    ptdp_fraction: float | None = None
    note: str = ""

    @classmethod
    def of(cls, *, m: int, v: int, tf: float, tb: float, tw: float,
           bubble_size: float | None, **fields) -> "ClosedForm":
        """Fill in the work per rank (every rank runs m·v forwards and backwards) and the
        ratio from ``bubble_size``."""
        work = m * v * (tf + tb + tw)
        ratio = None if bubble_size is None else ratio_from_size(bubble_size, work)
        return cls(bubble_size=bubble_size, work_per_rank=work, bubble_ratio=ratio, **fields)

    def to_dict(self) -> dict:
        """JSON-ready; the optional fields only where set."""
        out = {"formula": self.formula, "source": self.source, "bubble_size": self.bubble_size,
               "bubble_ratio": self.bubble_ratio, "exact": self.exact,
               "conditions": self.conditions, "work_per_rank": self.work_per_rank}
        for key in ("paper_bubble_size", "ptdp_fraction", "note"):
            value = getattr(self, key)
            if value is not None and value != "":
                out[key] = value
        return out
