"""Figures of a results set: step time per case, wire bytes measured against predicted."""
from __future__ import annotations

from pathlib import Path

from ..results import Row
from .cells import degrees


def figures(rows: list[Row], out_dir: Path) -> list[Path]:
    """Step time per case and wire bytes measured vs predicted, as PNGs."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    timed = [r for r in rows if r.time.step_s]
    if timed:
        fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(timed) + 2), 4))
        labels = [f"{r.scheme}\n{degrees(r)}" for r in timed]
        ax.bar(range(len(timed)), [r.time.step_s * 1e3 for r in timed],
               color=["#4C72B0" if not r.case.baseline_of else "#999999" for r in timed])
        ax.set_xticks(range(len(timed)), labels, rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("median step time (ms)")
        ax.set_title("Step time (grey: baselines)")
        fig.tight_layout()
        p = out_dir / "step_time.png"
        fig.savefig(p, dpi=120)
        plt.close(fig)
        paths.append(p)
    wired = [r for r in rows if r.traffic.wire_max()]
    if wired:
        fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(wired) + 2), 4))
        meas = [sum(r.traffic.wire_max().values()) for r in wired]
        pred = [sum(v for v in (r.traffic.wire_predicted_max() or {}).values() if v)
                for r in wired]
        xs = range(len(wired))
        ax.bar([x - 0.2 for x in xs], [m / 2**10 for m in meas], 0.4, label="measured")
        ax.bar([x + 0.2 for x in xs], [p / 2**10 for p in pred], 0.4, label="predicted")
        ax.set_xticks(list(xs), [f"{r.scheme}\n{degrees(r)}" for r in wired], rotation=60,
                      ha="right", fontsize=7)
        ax.set_ylabel("wire bytes per rank per step (KiB)")
        ax.legend()
        fig.tight_layout()
        p = out_dir / "wire_bytes.png"
        fig.savefig(p, dpi=120)
        plt.close(fig)
        paths.append(p)
    return paths
