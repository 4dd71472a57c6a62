"""Per-rank compute and communication events, bubble ratio, Chrome-trace export.

Bubble ratio = 1 - busy / (ranks * makespan), where busy is the union of a rank's compute
intervals and the makespan runs from the earliest start to the latest end over all ranks.
"""
from __future__ import annotations

import json
import time
from contextlib import nullcontext
from dataclasses import dataclass, field, fields


@dataclass
class Event:
    rank: int
    kind: str  # compute: F, B, W, BW, step, optim, ...; comm: the op name
    start: float
    end: float
    cat: str = "compute"  # compute | comm
    mb: int = -1
    stage: int = -1
    meta: dict = field(default_factory=dict)
    #: CPU seconds the recording thread spent inside the span (-1: not recorded). With one
    #: thread per rank this is the op's cost on a core of its own: unlike the wall time it
    #: leaves out the time the rank was descheduled while ranks share cores.
    cpu: float = -1.0


_EVENT_FIELDS = tuple(f.name for f in fields(Event) if f.name != "meta")


class _Span:
    __slots__ = ("tl", "kind", "mb", "stage", "meta", "t0", "c0")

    def __init__(self, tl, kind, mb, stage, meta):
        self.tl, self.kind, self.mb, self.stage, self.meta = tl, kind, mb, stage, meta

    def __enter__(self):
        self.t0, self.c0 = time.perf_counter(), time.thread_time()

    def __exit__(self, *exc) -> None:
        tl = self.tl
        tl.events.append(Event(tl.rank, self.kind, self.t0, time.perf_counter(), "compute",
                               self.mb, self.stage, self.meta, time.thread_time() - self.c0))


_NO_SPAN = nullcontext()


class Timeline:
    def __init__(self, rank: int = 0, enabled: bool = True):
        self.rank = rank
        self.enabled = enabled
        self.events: list[Event] = []

    def span(self, kind: str, mb: int = -1, stage: int = -1, **meta):
        """``with timeline.span("F", mb, stage):`` one compute event around the block (its
        wall and thread-CPU seconds); nothing when the timeline is off. A small context
        object, not a generator: a span is on the instruments' path of every action."""
        if not self.enabled:
            return _NO_SPAN
        return _Span(self, kind, mb, stage, meta)

    def add(self, kind: str, start: float, end: float, cat: str = "compute", mb: int = -1,
            stage: int = -1, **meta) -> None:
        if self.enabled:
            self.events.append(Event(self.rank, kind, start, end, cat, mb, stage, meta))

    def add_comm(self, rec) -> None:
        if self.enabled:
            self.events.append(Event(self.rank, rec.op, rec.start, rec.end, "comm",
                                     meta={"axis": rec.axis, "bytes": rec.message_bytes}))

    def clear(self) -> None:
        self.events.clear()

    def events_of(self, cat: str | None = None) -> list[Event]:
        """The events (of category ``cat`` only, when given), a new list: ``clear`` leaves
        it as it is."""
        return [e for e in self.events if cat is None or e.cat == cat]

    def as_dicts(self, cat: str | None = None) -> list[dict]:
        """The events as plain dicts (``as_dicts``), of category ``cat`` only when given."""
        return as_dicts(self.events_of(cat))


def as_dicts(events: list[Event]) -> list[dict]:
    """Events as plain dicts: each field copied, ``meta`` one level deep
    (``dataclasses.asdict`` deep-copies every value, which a pipeline paid on every step)."""
    return [{**{f: getattr(e, f) for f in _EVENT_FIELDS}, "meta": dict(e.meta)}
            for e in events]


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def bubble_ratio(events: list[dict], kinds: tuple[str, ...] = ("F", "B", "W", "BW"),
                 ranks: int | None = None) -> dict:
    """Measured bubble from compute events of all ranks: overall and per rank."""
    ev = [e for e in events if e["cat"] == "compute" and e["kind"] in kinds]
    if not ev:
        return {"overall": None, "per_rank": {}, "makespan": 0.0}
    t0 = min(e["start"] for e in ev)
    t1 = max(e["end"] for e in ev)
    span = t1 - t0
    by_rank: dict[int, list] = {}
    for e in ev:
        by_rank.setdefault(e["rank"], []).append((e["start"], e["end"]))
    n = ranks or len(by_rank)
    busy = {r: _union_length(iv) for r, iv in by_rank.items()}
    per_rank = {r: 1 - b / span if span > 0 else 0.0 for r, b in busy.items()}
    overall = 1 - sum(busy.values()) / (n * span) if span > 0 else 0.0
    return {"overall": overall, "per_rank": per_rank, "makespan": span}


def chrome_trace(events: list[dict], path: str) -> None:
    """Write events as a Chrome trace (opens in Perfetto / chrome://tracing)."""
    if not events:
        t0 = 0.0
    else:
        t0 = min(e["start"] for e in events)
    out = []
    for e in events:
        name = e["kind"] if e["mb"] < 0 else f"{e['kind']}{e['mb']}"
        if e.get("stage", -1) >= 0:
            name += f"@s{e['stage']}"
        out.append({"name": name, "cat": e["cat"], "ph": "X", "pid": e["rank"],
                    "tid": 0 if e["cat"] == "compute" else 1,
                    "ts": (e["start"] - t0) * 1e6, "dur": max(e["end"] - e["start"], 0) * 1e6,
                    "args": e.get("meta", {})})
    for r in sorted({e["rank"] for e in events}):
        out.append({"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}})
    with open(path, "w") as fh:
        json.dump({"traceEvents": out, "displayTimeUnit": "ms"}, fh)
