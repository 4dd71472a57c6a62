"""Text grid, PNG timeline and JSON summary of a schedule."""
from __future__ import annotations

import json

import pytest

from parbench.schedules import (
    GridEvent,
    TimelinePanel,
    events_from_sim,
    grid_text,
    make_schedule,
    plot_timeline,
    simulate,
    summary,
)
from parbench.schedules.closed_forms import ratio_from_size


def _cells(line: str, width: int) -> list[str]:
    body = line.split("| ", 1)[1]
    return [body[i:i + width].strip() for i in range(0, len(body), width)]


def test_grid_unit_costs_one_cell_per_time_unit():
    p, m = 4, 8
    schedule = make_schedule("zb-h1", p, m)
    sim = simulate(schedule, 1, 1, 1)
    lines = grid_text(schedule, sim).splitlines()
    assert len(lines) == p + 1 and "one cell = 1 time unit" in lines[-1]
    width = max(len(schedule.label(a)) for row in schedule.actions for a in row) + 1
    idle = (p - 1) * (1 + 1 - 1)       # ZB-H1 bubble (p-1)(T_F+T_B-T_W)
    for rank in range(p):
        cells = _cells(lines[rank], width)
        cells += ["."] * (3 * m + idle - len(cells))  # trailing idle cells are stripped
        assert len(cells) == 3 * m + idle
        assert cells.count(".") == idle
        assert sorted(c for c in cells if c != ".") == sorted(
            schedule.label(a) for a in schedule.actions[rank])


def test_grid_multi_unit_actions_and_fractional_quantum():
    schedule = make_schedule("1f1b", 2, 2)
    sim = simulate(schedule, tf=0.5, tb=1.0, tw=0.5)   # F = 1 cell of 0.5, BW = 3 cells
    text = grid_text(schedule, sim)
    assert "one cell = 0.5 time units" in text
    assert "BW0 -   -" in text
    looped = make_schedule("interleaved", 2, 2, 2)
    assert "F0c1" in grid_text(looped, simulate(looped))


def test_grid_coarsens_long_timelines():
    schedule = make_schedule("gpipe", 2, 3)
    sim = simulate(schedule, tf=1.0, tb=1.001, tw=0.0)
    text = grid_text(schedule, sim, max_cells=40)
    assert all(len(line) < 40 * 5 + 20 for line in text.splitlines()[:-1])


def test_events_and_plot(tmp_path):
    schedule = make_schedule("zb-h2", 4, 8)
    sim = simulate(schedule)
    events = events_from_sim(sim)
    assert len(events) == schedule.num_actions()
    assert all(isinstance(e, GridEvent) and e.end > e.start for e in events)
    path = plot_timeline(TimelinePanel(events, "zb-h2 p=4 m=8"), tmp_path / "zbh2.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # measured timelines arrive as dicts and may hold other kinds (e.g. communication)
    measured = [{"rank": 0, "kind": "F", "mb": 0, "stage": 0, "start": 0.0, "end": 1.0},
                {"rank": 1, "kind": "send", "mb": 0, "stage": 0, "start": 1.0, "end": 1.2}]
    other = plot_timeline(TimelinePanel(measured), tmp_path / "measured.png")
    assert other.stat().st_size > 0
    # the pipeline figure: simulated above, measured below, in one file and one legend
    both = plot_timeline([TimelinePanel(events, "simulated", "time (T_F units)"),
                          TimelinePanel(measured, "measured", "time (ms)")],
                         tmp_path / "sub" / "both.png", ranks=4,
                         label=lambda e: f"mb{e.mb}")
    assert both.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_summary_is_json_and_carries_the_closed_form():
    p, m = 4, 8
    schedule = make_schedule("zb-h1", p, m)
    sim = simulate(schedule, 1, 1, 1)
    data = json.loads(json.dumps(summary(schedule, sim)))
    assert data["makespan"] == sim.makespan and len(data["bubble_per_rank"]) == p
    assert data["peak_inflight_per_rank"][0] == p
    closed = data["closed_form"]
    assert closed["exact"] and closed["bubble_size"] == (p - 1) * (1 + 1 - 1)
    assert closed["bubble_ratio"] == pytest.approx(ratio_from_size((p - 1), 3 * m))
    assert data["bubble_ratio"] == pytest.approx(closed["bubble_ratio"])
    custom = simulate(schedule, cost=lambda a: 1.0)
    assert summary(schedule, custom)["closed_form"] is None


def test_the_schedule_verb_simulates_large_schedules_and_only_caps_the_grid(capsys):
    """``parbench schedule 1f1b p=64 m=1024``: 131,072 actions, above the grid's cap, so the
    grid is not drawn, but every figure is simulated: the bubble is 1F1B's (p-1)/(m+p-1)."""
    from parbench.cli.schedule import MAX_SLOTS, cmd_schedule
    assert cmd_schedule(["1f1b", "p=64", "m=1024"]) == 0
    out = capsys.readouterr().out
    assert f"grid not drawn: p*m*v*segments=65536 is above {MAX_SLOTS}" in out
    ratio = next(line for line in out.splitlines() if line.startswith("bubble_ratio:"))
    assert abs(float(ratio.split(":")[1]) - 63 / (1024 + 63)) < 1e-9
    assert cmd_schedule(["1f1b", "p=4", "m=8"]) == 0
    assert "grid not drawn" not in capsys.readouterr().out
