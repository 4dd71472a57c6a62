"""Append-only JSONL results: one row per finished case, written as soon as it ends."""
from __future__ import annotations

import json
import os
from pathlib import Path


def append_row(path: Path | str, row: dict) -> None:
    """Append one JSON line and flush it to disk, so an interrupted suite keeps it."""
    with open(path, "a") as fh:
        fh.write(json.dumps(row, sort_keys=True, default=_default) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def _default(o):
    if hasattr(o, "item"):
        return o.item()
    return str(o)


def load_rows(path: Path | str) -> list[dict]:
    """Rows of a results file (a truncated last line from a killed run is skipped)."""
    p = Path(path)
    if p.is_dir():
        p = p / "results.jsonl"
    rows = []
    if not p.exists():
        return rows
    with open(p) as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def to_frame(rows: list[dict]):
    """Flatten rows into a pandas DataFrame (one row per case)."""
    import pandas as pd
    flat = []
    for r in rows:
        f = {k: v for k, v in r.items() if not isinstance(v, (dict, list))}
        for a, v in (r.get("wire_bytes") or {}).items():
            f[f"wire_{a}"] = v
        for a, v in (r.get("wire_bytes_predicted") or {}).items():
            f[f"wire_{a}_predicted"] = v
        peaks = [x for x in r.get("peak_bytes") or [] if x is not None]
        f["peak_bytes_max"] = max(peaks) if peaks else None
        for k, v in (r.get("extra") or {}).items():
            if not isinstance(v, (dict, list)):
                f[k] = v
        flat.append(f)
    return pd.DataFrame(flat)
