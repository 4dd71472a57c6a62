"""``parbench plan``: placeholder, being written."""
from __future__ import annotations

from .output import UsageError


def cmd_plan(args: list[str], as_json: bool = False, wide: bool = False) -> int:
    raise UsageError("plan is not written yet")
