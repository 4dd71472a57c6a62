"""``parbench verify``: placeholder, being written."""
from __future__ import annotations

from .output import UsageError


def cmd_verify(args: list[str], as_json: bool = False, wide: bool = False) -> int:
    raise UsageError("verify is not written yet")
