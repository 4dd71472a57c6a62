"""Reading a results directory or ``results.jsonl`` for ``parbench compare`` (bad input is
one ConfigError naming the file and the rule)."""
from __future__ import annotations

import sys
from pathlib import Path

from ..config import ConfigError
from ..results import Row, decode_rows


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
    mid-write) is left out, saying so on stderr, as ``load_rows`` does; a malformed line
    before it, an unreadable file or a file without rows is a ConfigError."""
    f = results_path(path, what)
    try:
        lines = f.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{what}={path} cannot be read ({type(e).__name__}: "
                          f"{getattr(e, 'strerror', None) or e})") from None
    rows, bad = decode_rows(lines)
    last = max((n for n, line in enumerate(lines, start=1) if line.strip()), default=0)
    for n, why in bad:
        if n != last or not rows:
            raise ConfigError(f"{what}={path}: line {n} is not a results row ({why})")
    if bad:
        sys.stderr.write(f"parbench: {what}={path}: left out line {last}, not a results row "
                         "(a run killed mid-write?)\n")
    if not rows:
        raise ConfigError(f"{what}={path} has no rows")
    return rows


# ---- matching ----------------------------------------------------------------------------
