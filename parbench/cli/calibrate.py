"""``parbench calibrate``: placeholder, being written."""
from __future__ import annotations

from .output import UsageError


def cmd_calibrate(args: list[str], as_json: bool = False, wide: bool = False) -> int:
    raise UsageError("calibrate is not written yet")
