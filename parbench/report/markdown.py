"""The markdown report (``report.md``): one line per case, every family together."""
from __future__ import annotations

from pathlib import Path

from ..results import Row
from . import cells
from .figures import figures
from .tables import baseline_ratios


def markdown(rows: list[Row]) -> str:
    ratios = baseline_ratios(rows)
    lines = ["# parbench results", "",
             "Bytes per rank per step; KiB = 2^10, MiB = 2^20 bytes. 'x =' means measured equals "
             "the analytic prediction exactly.", "",
             "| scheme | degrees | equivalent | max abs dloss | max abs dparam | step ms | "
             "peak/rank | model states | wire bytes | ours / baseline |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rat = "; ".join(f"{v:.2f}x {b}" for b, v in ratios.get(r.id, [])) or "-"
        lines.append("| " + " | ".join([
            r.scheme, cells.degrees(r), cells.verdict(r, markup=False),
            cells.fmt_sci(r.verdict.max_loss_abs), cells.fmt_sci(r.verdict.max_param_abs),
            cells.fmt_ms(r.time.step_s), cells.peak(r, per_rank=False), cells.states(r),
            cells.wire_detail(r).replace("\n", "; "), rat]) + " |")
    return "\n".join(lines) + "\n"



def write_report(rows: list[Row], out_dir: Path) -> list[Path]:
    out_dir = Path(out_dir)
    md = out_dir / "report.md"
    md.write_text(markdown(rows))
    return [md, *figures(rows, out_dir / "figures")]
