"""Pictures of a schedule: a text grid for the CLI, a PNG timeline, a JSON summary.

`plot_timeline` is parbench's one schedule plotter: it draws panels of per-rank
events, so the same function shows simulated timelines (`events_from_sim`) and
measured ones recorded by the harness (the pipeline scheme's figure stacks the
two).  An event is anything with rank, kind, mb, stage, start and end — a
`GridEvent`, a dict with those keys, or a tuple in that order.
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from math import gcd
from pathlib import Path
from typing import Callable, Iterable, NamedTuple, Sequence

from .actions import Schedule
from .registry import closed_form
from .simulate import SimResult

#: block colours: F blue-ish, B green-ish, W orange-ish, fused BW purple
COLORS = {"F": "#4C72B0", "B": "#55A868", "W": "#DD8452", "BW": "#8172B3"}
OTHER_COLOR = "#9A9A9A"


class GridEvent(NamedTuple):
    """One timed op on one rank (compute, or anything else a measured timeline holds)."""

    rank: int
    kind: str
    mb: int
    stage: int
    start: float
    end: float
    pipe: int = 0


def events_from_sim(sim: SimResult) -> list[GridEvent]:
    """The simulated actions as `GridEvent` rows, rank by rank in execution order."""
    rows = []
    for rank, row in enumerate(sim.schedule.actions):
        for a in row:
            start, end = sim.times[a]
            rows.append(GridEvent(rank, a.kind, a.mb, a.stage, start, end, a.pipe))
    return rows


def _as_event(row) -> GridEvent:
    if isinstance(row, GridEvent):
        return row
    if isinstance(row, dict):
        pipe = row.get("pipe", (row.get("meta") or {}).get("pipe", 0))
        return GridEvent(int(row["rank"]), str(row["kind"]), int(row.get("mb", -1)),
                         int(row.get("stage", -1)), float(row["start"]), float(row["end"]),
                         int(pipe))
    return GridEvent(*row)


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


@dataclass(frozen=True)
class TimelinePanel:
    """One panel of a timeline figure: per-rank events, a title and the time axis' unit."""

    events: Sequence
    title: str = ""
    xlabel: str = "time"


def _block_text(event: GridEvent) -> str:
    return str(event.mb) if event.mb >= 0 else ""


def _draw_panel(ax, events: list[GridEvent], ranks: int, panel: TimelinePanel,
                label: Callable[[GridEvent], str]) -> None:
    end = max((e.end for e in events), default=1.0) or 1.0
    for e in events:
        ax.barh(e.rank, e.end - e.start, left=e.start, height=0.8,
                color=COLORS.get(e.kind, OTHER_COLOR), edgecolor="white", linewidth=0.5)
        text = label(e)
        if text and (e.end - e.start) > end * 0.004 * len(text):  # only where it fits
            ax.text((e.start + e.end) / 2, e.rank, text, ha="center", va="center",
                    fontsize=7, color="white")
    ax.set_yticks(range(ranks))
    ax.set_yticklabels([f"rank {r}" for r in range(ranks)])
    ax.set_ylim(ranks - 0.5, -0.5)
    ax.set_xlim(0, end)
    ax.set_xlabel(panel.xlabel)
    if panel.title:
        ax.set_title(panel.title, loc="left", fontsize=9)


def plot_timeline(panels: TimelinePanel | Sequence[TimelinePanel], path,
                  ranks: int | None = None,
                  label: Callable[[GridEvent], str] | None = None) -> Path:
    """Draw per-rank events as coloured blocks, one panel above the other; save a PNG.

    Ranks are rows (rank 0 at the top); gaps between blocks are the bubbles.  A block
    shows ``label(event)`` (default: the micro-batch number); one legend lists the kinds
    drawn, in the colours of `COLORS`.  Returns `path` (parent folders are created).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    panels = [panels] if isinstance(panels, TimelinePanel) else list(panels)
    events = [[_as_event(r) for r in panel.events] for panel in panels]
    everything = [e for evs in events for e in evs]
    n = ranks if ranks is not None else (max((e.rank for e in everything), default=-1) + 1)
    n = max(n, 1)
    longest = max((len(evs) for evs in events), default=0)
    fig = Figure(figsize=(min(4 + 0.25 * longest / n, 24),
                          len(panels) * (0.6 * n + 1.0) + 0.4))
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, squeeze=False)[:, 0]
    for ax, panel, evs in zip(axes, panels, events):
        _draw_panel(ax, evs, n, panel, label or _block_text)
    kinds = [k for k in COLORS if any(e.kind == k for e in everything)]
    if any(e.kind not in COLORS for e in everything):
        kinds.append("other")
    handles = [Patch(color=COLORS.get(k, OTHER_COLOR), label=k) for k in kinds]
    if handles:
        axes[0].legend(handles=handles, loc="lower right", bbox_to_anchor=(1.0, 1.0),
                       ncol=len(handles), frameon=False, fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path


def summary(schedule: Schedule, sim: SimResult) -> dict:
    """JSON-ready summary: makespan, bubble ratio overall and per rank, peaks, closed form."""
    params = sim.params
    closed = None
    if not params.get("custom_costs") and params.get("p2p", 0) == 0 and params.get("tbw") is None \
            and all(isinstance(params.get(k), (int, float)) for k in ("tf", "tb", "tw")):
        form = closed_form(schedule, params["tf"], params["tb"], params["tw"],
                           overlap=bool(params.get("overlap")))
        closed = None if form is None else form.to_dict()
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
        "peak_held_per_rank": sim.peak_held,
        "transfers": len(schedule.comm()),
        "closed_form": closed,
        "notes": schedule.notes,
    }
