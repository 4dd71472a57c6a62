"""Bubble ratio from events, and the Chrome trace export."""
from __future__ import annotations

import json

from parbench.timeline import bubble_ratio, chrome_trace


def ev(rank, kind, start, end, cat="compute", mb=0):
    return {"rank": rank, "kind": kind, "start": start, "end": end, "cat": cat, "mb": mb,
            "stage": rank, "meta": {}}


def test_bubble_ratio_two_ranks():
    # rank 0 busy [0,2] and [3,4]; rank 1 busy [1,4] -> busy 3 + 3 = 6 of 2 * 4 = 8
    events = [ev(0, "F", 0, 2), ev(0, "B", 3, 4), ev(1, "F", 1, 2), ev(1, "B", 2, 4),
              ev(1, "all_reduce", 0, 4, cat="comm")]
    b = bubble_ratio(events)
    assert abs(b["overall"] - 0.25) < 1e-12
    assert abs(b["per_rank"][0] - 0.25) < 1e-12 and abs(b["per_rank"][1] - 0.25) < 1e-12


def test_overlapping_events_counted_once():
    b = bubble_ratio([ev(0, "F", 0, 3), ev(0, "B", 1, 2), ev(0, "W", 3, 4)])
    assert b["overall"] == 0.0


def test_chrome_trace(tmp_path):
    p = tmp_path / "t.json"
    chrome_trace([ev(0, "F", 1.0, 1.5), ev(1, "send", 1.2, 1.3, cat="comm")], str(p))
    data = json.loads(p.read_text())
    xs = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in xs} == {0, 1}
    assert xs[0]["ts"] == 0 and abs(xs[0]["dur"] - 5e5) < 1e-6
