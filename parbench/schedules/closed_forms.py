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
@dataclass(frozen=True)
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
        "1f1b": TableRow("1f1b", (p - 1) * (tf + tb + tw), p, "M_B", 1.0, src),
        "zb-h1": TableRow("zb-h1", (p - 1) * (tf + tb - tw), p, "M_B", 1.0, src),
        "zb-h2": TableRow("zb-h2", (p - 1) * (tf + tb - 2 * tw), 2 * p - 1, "M_B", 1.0, src),
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
        "1f1b": TableRow("1f1b", (pp - 1) * (F + B), pp, "micro-batches", 1.0, src),
        "zb1p": TableRow("zb1p", (pp - 1) * (F + B - 2 * W), pp, "micro-batches", 1.0, src),
        "dualpipe": TableRow("dualpipe", (pp / 2 - 1) * (fb + B - 3 * W), pp + 1, "micro-batches", 2.0, src),
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
def max_inflight(schedule: str, p: int, m: int, rank: int = 0) -> int | None:
    """Peak micro-batches in flight (forward done, backward-for-inputs not) on `rank`.

    GPipe: m (all forwards before any backward; Huang et al. 2019).  1F1B /
    PipeDream-Flush: min(p - rank, m), at most p on rank 0 (Narayanan et al.
    2021, §2.2.1).  ZB-H1: as 1F1B; ZB-H2: min(2(p-1-rank)+1, m) (Qi et al. 2024).
    """
    if schedule == "gpipe":
        return m
    if schedule in ("1f1b", "pipedream", "2bw", "zb-h1"):
        return min(p - rank, m)
    if schedule == "zb-h2":
        return min(2 * (p - 1 - rank) + 1, m)
    return None


# -- the prediction for a generated schedule ---------------------------------------
def predict(schedule, tf: float = 1.0, tb: float = 1.0, tw: float = 1.0,
            overlap: bool = False) -> dict | None:
    """Closed-form bubble of `schedule` (a `Schedule`) for scalar costs, in parbench's terms.

    Returns None for schedules without a published closed form.  Keys: formula,
    source, bubble_size (idle time per rank from a common start, or None when the
    paper makes no claim for these costs), bubble_ratio (parbench's definition),
    exact (whether this generator reproduces it exactly under these conditions —
    checked by the unit tests), conditions; optionally paper_bubble_size (the
    paper's own metric, where it differs) and ptdp_fraction.
    """
    name, p, m, v = schedule.name, schedule.p, schedule.m, schedule.v
    per_op = tf + tb + tw
    work = m * schedule.num_stages / p * per_op
    out: dict = {"schedule": name}
    if name in ("gpipe", "1f1b", "pipedream", "2bw"):
        out.update(formula="(p-1)/(m+p-1)", source="Huang et al. 2019; Narayanan et al. 2021 §2.2.1",
                   bubble_size=pipeline_flush_size(p, tf, tb, tw), exact=True,
                   conditions="uniform stage costs, p2p=0", ptdp_fraction=ptdp_bubble_fraction(p, m))
        if schedule.asynchronous:
            out["note"] = "one iteration from a flush; without flushes the fill/drain is amortised"
    elif name in ("interleaved", "bfs"):
        out.update(formula="(p-1)/(v*m+p-1)", source="Narayanan et al. 2021 §2.2.2",
                   bubble_size=pipeline_flush_size(p, tf, tb, tw), exact=m >= p,
                   conditions="m >= p", ptdp_fraction=ptdp_bubble_fraction(p, m, v))
    elif name == "zb-h1":
        row = zero_bubble_table2(p, tf, tb, tw)["zb-h1"]
        out.update(formula="(p-1)(T_F+T_B-T_W)", source=row.source, bubble_size=row.bubble,
                   exact=m >= p and tw <= min(tf, tb), conditions="m >= p, T_W <= min(T_F, T_B)")
    elif name == "zb-h2":
        row = zero_bubble_table2(p, tf, tb, tw)["zb-h2"]
        out.update(formula="(p-1)(T_F+T_B-2T_W) per parallelogram; (p-1)max(T_F, T_F+T_B-2T_W) from start",
                   source=row.source, bubble_size=zb_h2_size_from_start(p, tf, tb, tw),
                   paper_bubble_size=row.bubble,
                   exact=m >= 2 * p - 1 and tw <= tf and 2 * tw <= tf + tb,
                   conditions="m >= 2p-1, T_W <= T_F, 2T_W <= T_F+T_B")
    elif name == "zbv":
        equal = zbv_span_bubble(p, tf, tb, tw) == 0.0
        out.update(formula="zero bubble per parallelogram when T_F=T_B=T_W",
                   source="Qi et al. 2024 §6", bubble_size=(p - 1) * tf if equal else None,
                   paper_bubble_size=0.0 if equal else None, exact=equal and m >= 2 * p - 1,
                   conditions="T_F = T_B = T_W, m >= 2p-1")
    elif name == "chimera":
        out.update(formula="(D-2)/(2N+D-2)", source="Li & Hoefler 2021, Table 2",
                   bubble_size=(p - 2) * tf if tf == tb + tw else None,
                   exact=tf == tb + tw, conditions="T_F = T_B + T_W (equal F and B slots)")
    elif name in ("dualpipe", "dualpipev"):
        pp = p if name == "dualpipe" else 2 * p
        row = dualpipe_table2(pp, tf, tb + tw, tw)["dualpipe"]
        out.update(formula="(PP/2-1)(F&B+B-3W)", source=row.source, bubble_size=row.bubble,
                   exact=overlap and tf <= tb and tw <= tb,
                   conditions="overlap=True (F&B pairs as units), T_F <= T_B, T_W <= T_B")
    else:
        return None
    size = out.get("bubble_size")
    out["bubble_ratio"] = None if size is None else ratio_from_size(size, work)
    out["work_per_rank"] = work
    return out
