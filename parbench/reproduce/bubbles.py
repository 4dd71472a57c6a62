"""Pipeline bubbles of GPipe, 1F1B and the interleaved schedule, against the simulator.

The published cells are the papers' closed forms (``parbench.schedules.closed_forms``)
evaluated for each configuration; the tool's figure is measured on the generated schedule by
the discrete-event simulator (``parbench.schedules.simulate``): its bubble ratio
1 - sum(busy) / (p x makespan), the bubble time over the ideal time (idle / busy per rank,
PTD-P's t_pb / t_id), or the peak number of micro-batches in flight on the first rank.
"""
from __future__ import annotations

from ..schedules import make_schedule, simulate
from ..schedules.closed_forms import (gpipe_bubble_ratio, gpipe_max_inflight,
                                      one_f_one_b_max_inflight, ptdp_bubble_fraction)
from .core import Cell, Reproduction, Setting, Source, Table

GPIPE = ("Huang, Cheng, Bapna, Firat, Chen, Chen, Lee, Ngiam, Le, Wu, Chen 2019, \"GPipe: "
         "Efficient Training of Giant Neural Networks using Pipeline Parallelism\", NeurIPS "
         "2019, arXiv 1811.06965")
PTDP = ("Narayanan et al. 2021, \"Efficient Large-Scale Language Model Training on GPU "
        "Clusters Using Megatron-LM\", SC21, arXiv 2104.04473")

#: (p stages, m micro-batches) and, for the interleaved schedule, v chunks per rank
CONFIGS = [(4, 8), (8, 32), (16, 64)]
CHUNKS = (2, 4)
#: per-stage costs: forward 1, fused backward 2 (the closed forms do not depend on them)
COSTS = dict(tf=1.0, tb=2.0, tw=0.0)


def idle(sim) -> float:
    """Idle time per rank inside the makespan (every rank does the same work here)."""
    return sim.makespan - min(sim.busy)


def fraction(sim) -> float:
    """Bubble time over ideal time, t_pb / t_id (PTD-P Sec. 2.2.1)."""
    return idle(sim) / min(sim.busy)


def bubble_table() -> Table:
    cells = []
    for p, m in CONFIGS:
        sim = simulate(make_schedule("gpipe", p, m), **COSTS)
        cells.append(Cell(f"GPipe, p = {p}, m = {m}: (p-1)/(m+p-1)",
                          gpipe_bubble_ratio(p, m), sim.bubble))
    for p, m in CONFIGS:
        sim = simulate(make_schedule("1f1b", p, m), **COSTS)
        cells.append(Cell(f"1F1B, p = {p}, m = {m}: (p-1)/m", ptdp_bubble_fraction(p, m),
                          fraction(sim)))
    for p, m in CONFIGS:
        for v in CHUNKS:
            sim = simulate(make_schedule("interleaved", p, m, v), **COSTS)
            cells.append(Cell(f"interleaved, p = {p}, m = {m}, v = {v}: (1/v)(p-1)/m",
                              ptdp_bubble_fraction(p, m, v), fraction(sim)))
    return Table(
        key="bubbles", title="Bubble of GPipe, 1F1B and interleaved 1F1B",
        source=Source(f"{GPIPE}; {PTDP}",
                      "GPipe Sec. 2.3 (bubble O((K-1)/(M+K-1)), taken as exact); PTD-P "
                      "Sec. 2.2.1 ((p-1)/m) and Sec. 2.2.2 ((1/v)(p-1)/m), bubble time over "
                      "ideal time",
                      "confirmed: the formulas are quoted by secondary summaries of both "
                      "papers"),
        config=[Setting("(p, m)", ", ".join(f"({p}, {m})" for p, m in CONFIGS),
                        "chosen; m a multiple of p as Megatron's interleaved schedule needs"),
                Setting("v (interleaved)", ", ".join(map(str, CHUNKS)), "chosen"),
                Setting("costs", "T_F = 1, fused backward 2, no p2p latency",
                        "chosen: the closed forms hold for any uniform costs")],
        method="simulate(make_schedule(name, p, m[, v]), tf=1, tb=2, tw=0): GPipe's "
               "bubble ratio; idle / busy per rank for PTD-P's fractions",
        tolerance=1e-9, cells=cells)


def inflight_table() -> Table:
    cells = []
    for p, m in CONFIGS:
        sim = simulate(make_schedule("gpipe", p, m), **COSTS)
        cells.append(Cell(f"GPipe, p = {p}, m = {m}: m micro-batches",
                          gpipe_max_inflight(p, m, 0), sim.peak_inflight[0], "micro-batches"))
        sim = simulate(make_schedule("1f1b", p, m), **COSTS)
        cells.append(Cell(f"1F1B, p = {p}, m = {m}: at most p",
                          one_f_one_b_max_inflight(p, m, 0), sim.peak_inflight[0],
                          "micro-batches"))
    return Table(
        key="inflight", title="Micro-batches in flight on the first stage",
        source=Source(f"{GPIPE}; {PTDP}",
                      "GPipe Sec. 2.3 (activations of all M micro-batches); PTD-P Sec. 2.2.1 "
                      "(1F1B keeps at most p micro-batches in flight)",
                      "confirmed: quoted by secondary summaries of both papers"),
        config=[Setting("(p, m)", ", ".join(f"({p}, {m})" for p, m in CONFIGS), "chosen")],
        method="simulate(...).peak_inflight[0]: forwards on rank 0 whose backward has not "
               "finished",
        tolerance=1e-9, cells=cells)


def reproduce() -> Reproduction:
    return Reproduction(
        name="bubbles", title="GPipe / 1F1B / interleaved: pipeline bubbles",
        tables=[bubble_table(), inflight_table()],
        intro="The bubble closed forms of GPipe and PTD-P beside the bubble the simulator "
              "measures on parbench's generated schedules.")
