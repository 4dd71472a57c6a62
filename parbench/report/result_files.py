"""Reading a results directory or ``results.jsonl`` for ``parbench compare`` (bad input is
one ConfigError naming the file and the rule)."""
from __future__ import annotations

import json
from pathlib import Path

from ..config import ConfigError
from ..results import Row


def results_path(path: str | Path, what: str = "path") -> Path:
    """The results.jsonl of a directory, or the file itself; ConfigError when absent."""
    p = Path(path)
    if p.is_dir():
        f = p / "results.jsonl"
        if not f.is_file():
            raise ConfigError(f"{what}={path} has no results.jsonl")
        return f
    if not p.exists():
        raise ConfigError(f"{what}={path} does not exist")
    return p


def read_rows(path: str | Path, what: str = "path") -> list[Row]:
    """The rows of a results directory or JSONL file. A malformed last line (a run killed
    mid-write) is skipped, as ``load_rows`` does; a malformed line before it, an unreadable
    file or a file without rows is a ConfigError."""
    f = results_path(path, what)
    try:
        lines = f.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{what}={path} cannot be read ({type(e).__name__}: "
                          f"{getattr(e, 'strerror', None) or e})") from None
    numbered = [(i + 1, ln.strip()) for i, ln in enumerate(lines) if ln.strip()]
    rows: list[Row] = []
    for k, (n, line) in enumerate(numbered):
        try:
            d = json.loads(line)
            if not isinstance(d, dict) or "id" not in d:
                raise TypeError("not a results row")
            rows.append(Row.from_dict(d))
        except (json.JSONDecodeError, TypeError, ValueError) as e:
            if k == len(numbered) - 1 and k > 0:
                continue  # truncated by a killed run
            raise ConfigError(f"{what}={path}: line {n} is not a results row "
                              f"({type(e).__name__})") from None
    if not rows:
        raise ConfigError(f"{what}={path} has no rows")
    return rows


# ---- matching ----------------------------------------------------------------------------
