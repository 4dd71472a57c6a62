"""``results.jsonl``: one JSON object per case, appended and flushed as soon as the case
ends; read back by ``load_rows`` (rows of either format; lines that are not rows are named on
stderr, never dropped silently)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from .row import Row

def append_row(path: Path | str, row: Row) -> None:
    """Append one JSON line and flush it to disk, so an interrupted suite keeps it."""
    with open(path, "a") as fh:
        fh.write(json.dumps(row.to_dict(), sort_keys=True, default=_default) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def _default(o):
    if hasattr(o, "item"):
        return o.item()
    return str(o)


def decode_rows(lines: list[str]) -> tuple[list[Row], list[tuple[int, str]]]:
    """(rows, [(line number, why)] of the lines that are not rows); blank lines skipped."""
    rows: list[Row] = []
    bad: list[tuple[int, str]] = []
    for n, line in enumerate(lines, start=1):
        line = line.strip()
        if not line:
            continue
        try:
            d = json.loads(line)
            if not isinstance(d, dict) or "id" not in d and "case" not in d:
                raise TypeError("not a results row")
            rows.append(Row.from_dict(d))
        except (json.JSONDecodeError, TypeError, ValueError, KeyError, AttributeError) as e:
            bad.append((n, type(e).__name__))
    return rows, bad


def load_rows(path: Path | str) -> list[Row]:
    """Rows of a results file or directory. Lines that are not rows (a truncated last line
    from a killed run, a damaged file) are left out and named on stderr."""
    p = Path(path)
    if p.is_dir():
        p = p / "results.jsonl"
    if not p.exists():
        return []
    rows, bad = decode_rows(p.read_text().splitlines())
    if bad:
        numbers = ", ".join(str(n) for n, _ in bad)
        sys.stderr.write(f"parbench: {p}: left out {len(bad)} line(s) that are not results "
                         f"rows: line {numbers}\n")
    return rows


def to_frame(rows: list[Row]):
    """Flatten rows into a pandas DataFrame (one row per case)."""
    import pandas as pd
    flat = []
    for r in rows:
        f = {"id": r.id, "suite": r.case.suite, "scheme": r.scheme, "family": r.case.family,
             "baseline_of": r.case.baseline_of, "world_size": r.case.world_size,
             **r.case.degrees(), "status": r.verdict.status, "passed": r.passed,
             "equivalent": r.verdict.equivalent, "step_time_s": r.time.step_s,
             "tokens_per_s": r.time.tokens_per_s}
        for a, v in r.traffic.wire_max().items():
            f[f"wire_{a}"] = v
        for a, v in (r.traffic.wire_predicted_max() or {}).items():
            f[f"wire_{a}_predicted"] = v
        peaks = [x for x in r.memory.peak_bytes if x is not None]
        f["peak_bytes_max"] = max(peaks) if peaks else None
        if r.pipeline is not None:
            for name, v in zip(("measured", "replayed", "sim_mean_costs", "unit",
                                "closed_form"), r.pipeline.ratios()):
                f[f"bubble_{name}"] = v
        for k, v in r.scheme_figures.items():
            if not isinstance(v, (dict, list)):
                f[k] = v
        flat.append(f)
    return pd.DataFrame(flat)
