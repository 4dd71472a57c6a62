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
* closed form: the paper's formula at the costs the paper states it for (the schedule's
  ``paper_costs``: unit costs, except Chimera's T_F = fused backward and DualPipe's
  overlapped F&B pairs), reported where it is exact for the generator
  (``parbench.schedules.paper_closed_form``, the same dispatch ``parbench schedule`` uses).

For the continuous pipelines (PipeDream, 2BW) the schedule is one steady step
(``parbench.schedules.steady_step``, a window whose previous step counts as done), the
measured steps are the steady ones relabelled to it, and the closed form is
``steady_closed_form``: the papers' steady state has no bubble, each harness step pays one
forward ramp.

Beside the bubbles: the graphs each rank held at most (measured from the saved storages,
``activations``), the simulator's count of the same (forward to fused backward or W) and of
the paper's in-flight count (forward to the backward-for-inputs), the paper's bound where it
states one, and the measured activation bytes.

Every rank gathers the per-op records of the pp group once (outside the ledger) and returns
the same figures, so the results row is complete whichever rank it is read from.
"""
from __future__ import annotations

import socket
import statistics
from collections import defaultdict
from dataclasses import asdict

from parbench.results import BubbleFigures
from parbench.schedules import (
    KINDS,
    Action,
    Schedule,
    get_spec,
    max_inflight,
    paper_closed_form,
    simulate,
    steady_closed_form,
)
from parbench.timeline import bubble_ratio


def _gather(obj, group):
    import torch.distributed as dist
    from parbench import comm
    out = [None] * dist.get_world_size(group)
    with comm.unrecorded():
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
                if schedule.rank_of(dep) == rank or dep not in times:
                    continue  # local, or done before a window (``done_before``)
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
        if len(costs) != schedule.num_actions() or \
                any(a not in costs for row in schedule.actions for a in row):
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


def _paper_bound(schedule: Schedule) -> list | None:
    spec = get_spec(schedule.name)
    if spec.max_inflight is None:
        return None
    return [max_inflight(schedule.name, schedule.p, schedule.m, r) for r in range(schedule.p)]


def bubble_metrics(schedule: Schedule, steps: list[list[dict]], group, *, held: int,
                   activation_bytes: int, per_microbatch: list[float]) -> dict:
    """All bubble and held-graph figures for the case, ``{"bubble": BubbleFigures}`` (the
    scheme's metrics; the harness moves it to the row's pipeline group; collective over the
    pp group);
    ``steps`` holds this rank's compute events of each measured step, ``held`` and
    ``activation_bytes`` its measured peaks, ``per_microbatch`` the analytic activation
    bytes of one micro-batch on each stage it holds."""
    mine = [[e for e in events if e["cat"] == "compute" and e["kind"] in KINDS]
            for events in steps]
    gathered = _gather({"host": socket.gethostname(), "steps": mine, "held": held,
                        "bytes": activation_bytes, "per_mb": per_microbatch}, group)
    one_host = len({g["host"] for g in gathered}) == 1
    step_events = []
    for i in range(min((len(g["steps"]) for g in gathered), default=0)):
        all_events = []
        for rank, g in enumerate(gathered):
            evs = g["steps"][i]
            t0 = 0.0 if one_host else min((e["start"] for e in evs), default=0.0)
            all_events += [dict(e, rank=rank, start=e["start"] - t0, end=e["end"] - t0)
                           for e in evs]
        step_events.append(all_events)
    unit = simulate(schedule)
    held_meas = [g["held"] for g in gathered]
    bound = _paper_bound(schedule)
    if schedule.done_before:  # a steady step of a continuous pipeline
        form = steady_closed_form(schedule.p, schedule.m)
        value = form.bubble_ratio
        costs = {"tf": 1.0, "tb": 1.0, "tw": 1.0, "overlap": False}
        at_costs = unit.bubble
    else:
        form, paper_costs = paper_closed_form(schedule)
        value = form.bubble_ratio if form is not None and form.exact else None
        costs = asdict(paper_costs)
        at_costs = simulate(schedule, **paper_costs.as_kwargs()).bubble
    note = "" if form is None else f"{form.formula}, {form.source}" + \
        (f" ({form.note})" if form.note else "")
    flat, detail = _from_measurements(schedule, step_events, one_host)
    detail.update({
        "unit": {"bubble": unit.bubble, "makespan": unit.makespan,
                 "per_rank": unit.bubble_per_rank},
        "closed_form_note": note, "closed_form_costs": costs,
        "sim_at_closed_form_costs": at_costs,
        "held_graphs_measured": held_meas, "held_graphs_simulated": unit.peak_held,
        "inflight_simulated": unit.peak_inflight, "inflight_paper_bound": bound,
        "activation_peak_bytes": [g["bytes"] for g in gathered],
        "activation_bytes_per_microbatch_analytic": [g["per_mb"] for g in gathered]})
    memory_note = get_spec(schedule.name).memory_note
    if memory_note:  # the paper's statement, beside the measured held graphs and bytes
        detail["paper_memory_note"] = memory_note
    paper = f"; paper F-B bound {_fmt(bound)}" if bound is not None else ""
    return {"bubble": BubbleFigures(
        schedule=f"{schedule.name} p={schedule.p} m={schedule.m} v={schedule.v}"
                 + (" (steady step)" if schedule.done_before else ""),
        measured=flat["bubble_measured"], replayed=flat["bubble_replayed"],
        sim_mean_costs=flat["bubble_sim_mean_costs"], unit=unit.bubble, closed_form=value,
        held_graphs=f"{_fmt(held_meas)} (sim {_fmt(unit.peak_held)}{paper})",
        activation_peak_bytes=[g["bytes"] for g in gathered], detail=detail)}
