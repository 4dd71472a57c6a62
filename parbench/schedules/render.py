"""Pictures of a schedule: a text grid for the CLI, a PNG timeline, a JSON summary.

`plot_timeline` draws any list of per-rank events, so the same function shows
simulated timelines (`events_from_sim`) and measured ones recorded by the
harness: an event is anything with rank, kind, mb, stage, start and end — an
`Event`, a dict with those keys, or a tuple in that order.
"""
from __future__ import annotations

from fractions import Fraction
from math import gcd
from typing import Iterable, NamedTuple

from .actions import Schedule
from .closed_forms import predict
from .simulate import SimResult

#: block colours: F blue-ish, B green-ish, W orange-ish, fused BW purple
COLORS = {"F": "#4C72B0", "B": "#55A868", "W": "#DD8452", "BW": "#8172B3"}
OTHER_COLOR = "#9A9A9A"


class Event(NamedTuple):
    """One timed op on one rank (compute, or anything else a measured timeline holds)."""

    rank: int
    kind: str
    mb: int
    stage: int
    start: float
    end: float
    pipe: int = 0


def events_from_sim(sim: SimResult) -> list[Event]:
    """The simulated actions as `Event` rows, rank by rank in execution order."""
    rows = []
    for rank, row in enumerate(sim.schedule.actions):
        for a in row:
            start, end = sim.times[a]
            rows.append(Event(rank, a.kind, a.mb, a.stage, start, end, a.pipe))
    return rows


def _as_event(row) -> Event:
    if isinstance(row, Event):
        return row
    if isinstance(row, dict):
        return Event(int(row["rank"]), str(row["kind"]), int(row.get("mb", -1)),
                     int(row.get("stage", -1)), float(row["start"]), float(row["end"]),
                     int(row.get("pipe", 0)))
    return Event(*row)


def _quantum(values: Iterable[float]) -> Fraction:
    """Largest time step of which every value is a whole multiple (values as fractions)."""
    num, den = 0, 1
    for x in values:
        f = Fraction(x).limit_denominator(1000)
        if f == 0:
            continue
        # gcd(num/den, a/b) = gcd(num*b, a*den) / (den*b)
        num, den = gcd(num * f.denominator, f.numerator * den), den * f.denominator
        g = gcd(num, den)
        num, den = num // g, den // g
    return Fraction(num, den) if num else Fraction(1)


def grid_text(schedule: Schedule, sim: SimResult, max_cells: int = 200) -> str:
    """Per-rank rows in time order, one cell per time quantum ('.' idle, '-' continuation).

    With unit costs a cell is one time unit, like the papers' diagrams.  When the
    makespan needs more than `max_cells` cells, cells are coarsened and a cell
    shows the action that starts in it.
    """
    times = [t for se in sim.times.values() for t in se]
    q = _quantum(times + [sim.makespan])
    cells = int(round(Fraction(sim.makespan).limit_denominator(1000) / q)) if sim.makespan else 0
    step = float(q)
    if cells > max_cells:
        cells, step = max_cells, sim.makespan / max_cells
    width = max((len(schedule.label(a)) for row in schedule.actions for a in row), default=2) + 1
    lines = []
    for rank, row in enumerate(schedule.actions):
        grid = ["." for _ in range(cells)]
        for a in row:
            start, end = sim.times[a]
            first = min(int(round(start / step)), cells - 1) if cells else 0
            last = max(first + 1, int(round(end / step)))
            if end == start:
                continue
            for c in range(first, min(last, cells)):
                grid[c] = "-" if grid[c] == "." else grid[c]
            grid[first] = schedule.label(a)
        lines.append(f"rank {rank:>2} | " + "".join(c.ljust(width) for c in grid).rstrip())
    unit = "1 time unit" if step == 1 else f"{step:g} time units"
    lines.append(f"(one cell = {unit}; '.' idle, '-' continues the action to its left)")
    return "\n".join(lines)


def plot_timeline(rows, path, title: str | None = None, ranks: int | None = None):
    """Draw per-rank events as coloured blocks with the micro-batch number; save a PNG.

    `rows`: events (see module docstring).  Ranks are rows (rank 0 at the top);
    gaps between blocks are the bubbles.  Returns `path`.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    events = [_as_event(r) for r in rows]
    n = ranks if ranks is not None else (max((e.rank for e in events), default=-1) + 1)
    end = max((e.end for e in events), default=1.0) or 1.0
    fig = Figure(figsize=(min(4 + 0.25 * len(events) / max(n, 1), 24), 0.6 * n + 1.4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for e in events:
        color = COLORS.get(e.kind, OTHER_COLOR)
        ax.barh(e.rank, e.end - e.start, left=e.start, height=0.8, color=color,
                edgecolor="white", linewidth=0.5)
        if e.mb >= 0 and (e.end - e.start) > end / 400:
            ax.text((e.start + e.end) / 2, e.rank, str(e.mb), ha="center", va="center",
                    fontsize=7, color="white")
    ax.set_yticks(range(n))
    ax.set_yticklabels([f"rank {r}" for r in range(n)])
    ax.set_ylim(n - 0.5, -0.5)
    ax.set_xlim(0, end)
    ax.set_xlabel("time")
    kinds = [k for k in COLORS if any(e.kind == k for e in events)]
    if any(e.kind not in COLORS for e in events):
        kinds.append("other")
    handles = [Patch(color=COLORS.get(k, OTHER_COLOR), label=k) for k in kinds]
    if handles:
        ax.legend(handles=handles, loc="lower right", bbox_to_anchor=(1.0, 1.0),
                  ncol=len(handles), frameon=False, fontsize=8)
    if title:
        ax.set_title(title, loc="left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def summary(schedule: Schedule, sim: SimResult) -> dict:
    """JSON-ready summary: makespan, bubble ratio overall and per rank, peaks, closed form."""
    params = sim.params
    closed = None
    if not params.get("custom_costs") and params.get("p2p", 0) == 0 and params.get("tbw") is None \
            and all(isinstance(params.get(k), (int, float)) for k in ("tf", "tb", "tw")):
        closed = predict(schedule, params["tf"], params["tb"], params["tw"],
                         overlap=bool(params.get("overlap")))
    return {
        "schedule": schedule.name,
        "p": schedule.p,
        "m": schedule.m,
        "v": schedule.v,
        "num_stages": schedule.num_stages,
        "split_backward": schedule.split_backward,
        "asynchronous": schedule.asynchronous,
        "costs": {k: v for k, v in params.items() if v is not None},
        "makespan": sim.makespan,
        "busy_per_rank": sim.busy,
        "bubble_ratio": sim.bubble,
        "bubble_per_rank": sim.bubble_per_rank,
        "idle_per_rank": sim.idle_time,
        "span_bubble": sim.span_bubble,
        "peak_inflight_per_rank": sim.peak_inflight,
        "peak_w_pending_per_rank": sim.peak_w_pending,
        "transfers": len(schedule.comm()),
        "closed_form": closed,
        "notes": schedule.notes,
    }
