"""Hanayo (wave placement), V-Half and V-Min: placement, closed forms, memory, the table."""
from __future__ import annotations

import pytest

from parbench.analytic import pipeline as closed
from parbench.schedules import (
    ScheduleError,
    closed_form,
    make_schedule,
    max_inflight,
    simulate,
    validate,
)
from parbench.schedules.actions import v_placement, wave_placement
from parbench.schedules.closed_forms import chimera_bubble_ratio, interleaved_bubble_ratio

EQUAL_SLOTS = {"tf": 1.0, "tb": 1.0, "tw": 0.0}  # the Hanayo and Chimera papers' slots


def test_wave_placement_zig_zags_and_generalises_the_v():
    assert wave_placement(4, 2) == v_placement(4)
    pl = wave_placement(2, 4)  # two waves: 0 1 | 1 0 | 0 1 | 1 0
    assert [pl[(0, s)] for s in range(8)] == [0, 1, 1, 0, 0, 1, 1, 0]
    for p, v in [(3, 4), (4, 6)]:
        pl = wave_placement(p, v)
        assert all(pl[(0, c * p + p - 1)] == pl[(0, (c + 1) * p)] for c in range(v - 1))
        for r in range(p):
            assert closed.stages_on_rank("wave", p, r, v) == \
                sorted(k for k, rank in pl.items() if rank == r)


@pytest.mark.parametrize("p,m,v", [(2, 4, 4), (4, 8, 2), (4, 8, 4), (3, 5, 6), (4, 6, 3)])
def test_wave_sends_are_the_closed_form(p, m, v):
    schedule = validate(make_schedule("hanayo", p, m, v))
    for r in range(p):
        fwd = sum(1 for t in schedule.comm() if t.src_rank == r and t.kind == "act")
        bwd = sum(1 for t in schedule.comm() if t.src_rank == r and t.kind == "grad")
        assert (fwd, bwd) == closed.p2p_sends("wave", p, m, r, v)


def test_hanayo_bubble_is_the_papers_at_equal_slots_when_p_divides_m():
    for p in (2, 3, 4, 6):
        for v in (2, 4, 6):
            for m in (p, 2 * p, 3 * p):
                schedule = validate(make_schedule("hanayo", p, m, v))
                sim = simulate(schedule, **EQUAL_SLOTS)
                form = closed_form(schedule, **EQUAL_SLOTS)
                assert form.exact
                assert sim.bubble == pytest.approx((p - 1) / (v * m + p - 1))
                assert form.bubble_ratio == pytest.approx(sim.bubble)
                # one replica, 1F1B's activations: v chunks of 1/v of a rank's layers, p deep
                assert max(sim.peak_inflight) <= v * p


def test_hanayo_default_is_one_wave_and_odd_v_ends_on_the_last_rank():
    assert make_schedule("hanayo", 4, 8).v == 2
    schedule = validate(make_schedule("hanayo", 4, 8, 3))
    assert schedule.placement[(0, 11)] == 3
    with pytest.raises(ScheduleError, match="v >= 2"):
        make_schedule("hanayo", 4, 8, 1)


def test_bubble_table_hanayo_chimera_interleaved():
    """The table of the brief: Hanayo against Chimera and interleaved at the same p, m
    (simulated at unit costs and at the papers' equal slots, beside the closed forms)."""
    lines = [f"{'p':>2} {'m':>3} {'schedule':<16} {'unit':>7} {'slots':>7} {'closed':>7}"]
    for p, m in [(4, 8), (4, 16), (8, 16)]:
        rows = [("chimera", None, chimera_bubble_ratio(p, m)),
                ("interleaved v=2", 2, interleaved_bubble_ratio(p, m, 2)),
                ("hanayo W=1", 2, (p - 1) / (2 * m + p - 1)),
                ("interleaved v=4", 4, interleaved_bubble_ratio(p, m, 4)),
                ("hanayo W=2", 4, (p - 1) / (4 * m + p - 1))]
        slots = {}
        for label, v, form in rows:
            schedule = make_schedule(label.split()[0], p, m, v)
            unit, eq = simulate(schedule).bubble, simulate(schedule, **EQUAL_SLOTS).bubble
            slots[label] = eq
            lines.append(f"{p:>2} {m:>3} {label:<16} {unit:7.4f} {eq:7.4f} {form:7.4f}")
            assert eq == pytest.approx(form)
        assert slots["hanayo W=2"] < slots["hanayo W=1"]
        assert slots["hanayo W=2"] < slots["chimera"]
    print("\n" + "\n".join(lines))  # shown with pytest -s
    assert len(lines) == 16


@pytest.mark.parametrize("name", ["vhalf", "vmin"])
def test_v_blocks_validate_and_meet_their_bubble(name):
    for p in range(2, 9):
        for m in range(1, 2 * p + 2):
            schedule = validate(make_schedule(name, p, m))
            sim = simulate(schedule)
            form = closed_form(schedule)
            if form.exact:
                assert sim.makespan - 6 * m == form.bubble_size
            bound = [max_inflight(name, p, m, r) for r in range(p)]
            assert all(s <= b for s, b in zip(sim.peak_inflight, bound)), (p, m)


@pytest.mark.parametrize("name,fraction", [("vhalf", 1 / 2), ("vmin", 1 / 3)])
def test_v_blocks_keep_the_papers_fraction_of_1f1b_activations(name, fraction):
    """Peak chunk activations in flight (F to B) against 1F1B's 2p chunks (p stages of two
    chunks each): at most fraction·2p + 2, and below 1F1B's; the bubble below 1F1B's."""
    for p in (4, 8, 12, 16):
        m = 2 * p
        sim = simulate(validate(make_schedule(name, p, m)))
        one_f_one_b = simulate(make_schedule("1f1b", p, m))
        peak = max(sim.peak_inflight)
        assert peak <= fraction * 2 * p + 2
        assert peak < 2 * max(one_f_one_b.peak_inflight)
        # held graphs (F to W): the W filler may keep one or two more than F to B
        assert max(sim.peak_held) <= fraction * 2 * p + 3
        assert sim.bubble < one_f_one_b.bubble
    assert max(simulate(make_schedule("vhalf", 16, 32)).peak_inflight) == 16 + 2


def test_v_blocks_split_backward_and_v_placement():
    for name in ("vhalf", "vmin"):
        schedule = make_schedule(name, 4, 8)
        assert schedule.split_backward and schedule.placement == v_placement(4)
        with pytest.raises(ScheduleError):
            make_schedule(name, 4, 8, 4)
