"""Bubble figures of one pipeline case, side by side (DESIGN.md, "Timeline").

* measured: 1 - busy / (p * makespan) from the wall-clock compute spans of the last checked
  step on every rank (one host: the monotonic clock is shared; several hosts: each rank's
  spans are aligned to its own first span);
* replayed: the simulator re-runs the schedule with every action's measured duration
  (``simulate(costs=...)``) -- the honest figure when ranks share CPU cores;
* simulated (measured means): the simulator with one cost per (kind, stage), the mean of the
  measured durations -- the "same costs" in per-kind form; its gap to *replayed* shows how
  much per-action variation matters;
* unit: the simulator with T_F = T_B = T_W = 1 (a fused backward costs 2);
* closed form: the paper's formula for the same unit costs where one is exact for the
  generator (``parbench.schedules.closed_forms``).

Every rank gathers the per-op records of the pp group once (outside the ledger) and returns
the same figures, so the results row is complete whichever rank it is read from.
"""
from __future__ import annotations

import statistics

import socket
from collections import defaultdict

import torch

from parbench.schedules import Action, simulate
from parbench.schedules import closed_forms as cf
from parbench.timeline import bubble_ratio

KINDS = ("F", "B", "W", "BW")


def stage_counts(cfg, stage: int, num_stages: int) -> tuple[int, int]:
    """(parameter elements, parameter tensors) of one stage, without allocating weights."""
    from parbench.model import Block, Embedding, Head, stage_layers
    lo, hi = stage_layers(cfg.num_layers, num_stages, stage)
    with torch.device("meta"):
        parts = [Block(cfg) for _ in range(lo, hi)]
        if stage == 0:
            parts.append(Embedding(cfg))
        if stage == num_stages - 1:
            parts.append(Head(cfg))
    tensors = [p for mod in parts for p in mod.parameters()]
    return sum(p.numel() for p in tensors), len(tensors)


def closed_form(schedule) -> tuple[float | None, str, dict]:
    """The paper's bubble ratio, its source, and the simulator costs it holds for.

    Unit costs are T_F = T_B = T_W = 1 (fused backward 2) unless the paper's own cost model
    differs (Chimera: T_F = fused backward; DualPipe: overlapped F&B pairs).
    """
    p, m, v, name = schedule.p, schedule.m, schedule.v, schedule.name
    unit: dict = {}
    if name in ("gpipe", "1f1b", "pipedream", "2bw"):
        note = "(p-1)/(m+p-1), GPipe Sec. 2.3 / PTD-P Sec. 2.2.1"
        if name in ("pipedream", "2bw"):
            note += " (per step: the harness flushes between steps)"
        return cf.gpipe_bubble_ratio(p, m), note, unit
    if name in ("interleaved", "bfs") and m >= p:
        return cf.interleaved_bubble_ratio(p, m, v), "(p-1)/(v*m+p-1), PTD-P Sec. 2.2.2", unit
    if name == "zb-h1" and m >= p:
        size = cf.zero_bubble_table2(p, 1, 1, 1)["zb-h1"].bubble
        return cf.ratio_from_size(size, 3 * m), \
            "(p-1)(T_F+T_B-T_W), Qi et al. 2024 Table 2", unit
    if name == "zb-h2" and m >= 2 * p - 1:
        return cf.ratio_from_size(cf.zb_h2_size_from_start(p, 1, 1, 1), 3 * m), \
            "(p-1)max(T_F, T_F+T_B-2T_W) from a common start, Qi et al. 2024 Table 2", unit
    if name == "zbv" and m >= 2 * p - 1:
        return cf.ratio_from_size((p - 1) * 1.0, 6 * m), \
            "zero bubble after the (p-1)T_F ramp, Qi et al. 2024 Sec. 6", unit
    if name == "chimera":
        return cf.chimera_bubble_ratio(p, m), \
            "(D-2)/(2N+D-2), Li & Hoefler 2021 Table 2 (T_F = fused backward)", \
            {"tf": 1.0, "tb": 1.0, "tw": 0.0}
    if name in ("dualpipe", "dualpipev"):
        stages = p if name == "dualpipe" else 2 * p
        size = cf.dualpipe_table2(stages, 1, 2, 1)["dualpipe"].bubble
        work = 3 * m if name == "dualpipe" else 6 * m
        return cf.ratio_from_size(size, work), \
            "(PP/2-1)(F&B+B-3W), DeepSeek-V3 Table 2, F&B pairs overlapped as units " \
            "(our executor runs them back to back)", {"overlap": True}
    return None, "", unit


def _gather(obj, group):
    import torch.distributed as dist
    from parbench import comm
    out = [None] * dist.get_world_size(group)
    led = comm.active()
    if led is not None:
        with led.pause():
            dist.all_gather_object(out, obj, group=group)
    else:
        dist.all_gather_object(out, obj, group=group)
    return out


def _action(e: dict) -> Action:
    return Action(e["kind"], e["mb"], e["stage"], e.get("meta", {}).get("pipe", 0))


def _fmt(values) -> str:
    return "/".join(str(v) for v in values)


def p2p_latency(schedule, times: dict) -> float:
    """Median delay between the end of a cross-rank producer and the start of its consumer,
    over the consumers that were already idle when the producer finished (so the delay is
    the transfer, not the consumer's own work)."""
    kinds = schedule.backward_kinds()
    samples = []
    for rank, row in enumerate(schedule.actions):
        prev_end = None
        for a in row:
            start, end = times[a]
            for dep in schedule.dependencies(a, kinds):
                if schedule.rank_of(dep) == rank:
                    continue
                dep_end = times[dep][1]
                if prev_end is None or prev_end <= dep_end:
                    samples.append(start - dep_end)
            prev_end = end
    samples.sort()
    return max(0.0, samples[len(samples) // 2]) if samples else 0.0


def _median(values: list[float]) -> float:
    return statistics.median(values)


def _from_measurements(schedule, steps: list[list[dict]], one_host: bool) -> tuple[dict, dict]:
    """Measured, replayed and mean-cost figures from the compute spans of every rank.

    ``steps`` holds each measured step's events (all ranks). The per-op cost fed to the
    replay is the thread CPU time of the op (falling back to wall time where none was
    recorded): with one thread per rank that is what the op costs on a core of its own, so
    the replay stays honest when ranks share cores and a rank's wall-clock spans include
    time it sat descheduled. Each action's cost is its median over the measured steps; the
    measured bubble (wall clock) and the p2p latency are medians over steps too.
    """
    per_step_costs, per_step_meas, per_step_lat = [], [], []
    for events in steps:
        costs = {_action(e): (e["cpu"] if e.get("cpu", -1.0) >= 0 else e["end"] - e["start"])
                 for e in events}
        if len(costs) != schedule.num_actions():
            continue
        per_step_costs.append(costs)
        per_step_meas.append(bubble_ratio(events, ranks=schedule.p))
        times = {_action(e): (e["start"], e["end"]) for e in events}
        per_step_lat.append(p2p_latency(schedule, times) if one_host else 0.0)
    if not per_step_costs:
        return ({"bubble_measured": None, "bubble_replayed": None,
                 "bubble_sim_mean_costs": None},
                {"missing": f"no step had all {schedule.num_actions()} actions timed"})
    costs = {a: _median([c[a] for c in per_step_costs]) for a in per_step_costs[0]}
    meas_bubble = _median([m["overall"] for m in per_step_meas])
    meas = min(per_step_meas, key=lambda m: abs(m["overall"] - meas_bubble))
    latency = _median(per_step_lat)
    replay = simulate(schedule, costs=costs, p2p=latency)
    replay0 = simulate(schedule, costs=costs)
    sums: dict = defaultdict(lambda: [0.0, 0])
    for a, t in costs.items():
        sums[(a.kind, a.stage)][0] += t
        sums[(a.kind, a.stage)][1] += 1
    means = {k: total / n for k, (total, n) in sums.items()}
    mean_sim = simulate(schedule, cost=lambda a: means[(a.kind, a.stage)], p2p=latency)
    per_kind = defaultdict(list)
    for a, t in costs.items():
        per_kind[a.kind].append(t)
    flat = {"bubble_measured": meas_bubble, "bubble_replayed": replay.bubble,
            "bubble_sim_mean_costs": mean_sim.bubble}
    detail = {
        "steps_measured": len(per_step_costs),
        "measured": {"bubble": meas_bubble, "makespan_s": meas["makespan"],
                     "per_rank": [meas["per_rank"].get(r) for r in range(schedule.p)],
                     "per_step": [m["overall"] for m in per_step_meas]},
        "replayed": {"bubble": replay.bubble, "makespan_s": replay.makespan,
                     "per_rank": replay.bubble_per_rank, "p2p_latency_s": latency},
        "replayed_zero_latency": {"bubble": replay0.bubble, "makespan_s": replay0.makespan},
        "sim_mean_costs": {"bubble": mean_sim.bubble, "makespan_s": mean_sim.makespan},
        "replayed_minus_sim_mean_costs_pp": 100 * (replay.bubble - mean_sim.bubble),
        "measured_minus_replayed_pp": 100 * (meas_bubble - replay.bubble),
        "mean_cost_s": {k: sum(v) / len(v) for k, v in per_kind.items()},
    }
    return flat, detail


def bubble_metrics(schedule, steps: list[list[dict]], group, peak_inflight: int) -> dict:
    """All bubble figures for the case (collective over the pp group); ``steps`` holds this
    rank's compute events of each measured step."""
    mine = [[e for e in events if e["cat"] == "compute" and e["kind"] in KINDS]
            for events in steps]
    gathered = _gather({"host": socket.gethostname(), "steps": mine,
                        "peak_inflight": peak_inflight}, group)
    one_host = len({g["host"] for g in gathered}) == 1
    step_events = []
    for i in range(min(len(g["steps"]) for g in gathered)):
        all_events = []
        for rank, g in enumerate(gathered):
            evs = g["steps"][i]
            t0 = 0.0 if one_host else min((e["start"] for e in evs), default=0.0)
            all_events += [dict(e, rank=rank, start=e["start"] - t0, end=e["end"] - t0)
                           for e in evs]
        step_events.append(all_events)
    unit = simulate(schedule)
    meas_peaks = [g["peak_inflight"] for g in gathered]
    value, note, cf_costs = closed_form(schedule)
    flat, detail = _from_measurements(schedule, step_events, one_host)
    detail.update({
        "unit": {"bubble": unit.bubble, "makespan": unit.makespan,
                 "per_rank": unit.bubble_per_rank},
        "closed_form_note": note, "closed_form_costs": cf_costs,
        "sim_at_closed_form_costs": simulate(schedule, **cf_costs).bubble,
        "peak_inflight_measured": meas_peaks, "peak_inflight_simulated": unit.peak_inflight})
    return {"schedule": f"{schedule.name} p={schedule.p} m={schedule.m} v={schedule.v}",
            "peak_inflight": f"{_fmt(meas_peaks)} (sim {_fmt(unit.peak_inflight)})",
            **flat, "bubble_unit": unit.bubble, "bubble_closed_form": value,
            "bubble_detail": detail}
