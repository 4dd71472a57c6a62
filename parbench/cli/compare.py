"""``parbench compare OLD NEW``: placeholder, being written."""
from __future__ import annotations

from .output import UsageError


def cmd_compare(args: list[str], as_json: bool = False, wide: bool = False) -> int:
    raise UsageError("compare is not written yet")
