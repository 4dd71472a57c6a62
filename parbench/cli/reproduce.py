"""``parbench reproduce``: placeholder, being written."""
from __future__ import annotations

from .output import UsageError


def cmd_reproduce(args: list[str], as_json: bool = False, wide: bool = False) -> int:
    raise UsageError("reproduce is not written yet")
