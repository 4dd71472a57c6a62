"""Schedule diagrams in the papers' style: ranks as rows, F / B / W blocks per micro-batch.

One PNG per case with two panels: the simulated schedule (unit costs T_F = T_B = T_W = 1)
and the measured one (the wall-clock compute spans of the last checked step). Bubbles are
the white gaps. Colours: forward blue, input backward green, weight backward grey, fused
backward red; the number in a block is the micro-batch (with the chunk when a rank holds
several stages).
"""
from __future__ import annotations

from pathlib import Path

COLOURS = {"F": "#4C72B0", "B": "#55A868", "W": "#8C8C8C", "BW": "#C44E52"}


def _draw(ax, blocks, p: int, title: str, unit: str) -> None:
    """blocks: (rank, start, end, kind, label)."""
    span = max((e for _, _, e, _, _ in blocks), default=1.0) or 1.0
    for rank, start, end, kind, label in blocks:
        ax.barh(rank, end - start, left=start, height=0.8, color=COLOURS.get(kind, "#999"),
                edgecolor="white", linewidth=0.5)
        if (end - start) / span > 0.012:
            ax.text((start + end) / 2, rank, label, ha="center", va="center", fontsize=6,
                    color="white")
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
    ax.invert_yaxis()
    ax.set_xlim(0, span)
    ax.set_xlabel(unit)
    ax.set_title(title, fontsize=9)


def write_schedule_figure(schedule, per_rank: list[dict], path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    from parbench.schedules import Action, simulate

    sim = simulate(schedule)

    def label(a: Action) -> str:
        return schedule.label(a).lstrip("FBW")

    sim_blocks = [(schedule.rank_of(a), s, e, a.kind, label(a)) for a, (s, e) in
                  sim.times.items()]
    events = [dict(ev, rank=r["rank"]) for r in per_rank for ev in r.get("timeline", [])
              if ev["cat"] == "compute" and ev["kind"] in COLOURS]
    t0 = min((e["start"] for e in events), default=0.0)
    meas_blocks = [(e["rank"], (e["start"] - t0) * 1e3, (e["end"] - t0) * 1e3, e["kind"],
                    label(Action(e["kind"], e["mb"], e["stage"],
                                 e.get("meta", {}).get("pipe", 0))))
                   for e in events]
    width = min(22, 6 + 0.12 * schedule.num_actions() / schedule.p)
    fig, axes = plt.subplots(2, 1, figsize=(width, 1.2 + 0.9 * schedule.p), squeeze=True)
    name = f"{schedule.name} p={schedule.p} m={schedule.m} v={schedule.v}"
    _draw(axes[0], sim_blocks, schedule.p,
          f"{name}: simulated, unit costs (bubble {sim.bubble:.3f})", "time (T_F units)")
    _draw(axes[1], meas_blocks, schedule.p, f"{name}: measured (last checked step)",
          "time (ms)")
    axes[1].legend(handles=[Patch(color=c, label=k) for k, c in COLOURS.items()],
                   loc="upper center", bbox_to_anchor=(0.5, -0.3), fontsize=7, ncol=4,
                   frameon=False)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
