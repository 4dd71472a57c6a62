"""Output helpers shared by the verbs: JSON or rendered text, and a console sized to the
terminal."""
from __future__ import annotations

import json
import shutil
import sys

from ..config import ConfigError


class UsageError(ConfigError):
    """A verb used wrongly (exit 2, like any bad input)."""


def emit(obj, as_json: bool, render) -> None:
    """Print ``obj`` as JSON, or call ``render(obj)``."""
    if as_json:
        print(json.dumps(obj, indent=2, sort_keys=True, default=str))
    else:
        render(obj)


def terminal_width(default: int = 120) -> int:
    """The terminal's width (``COLUMNS`` wins; ``default`` when not a terminal)."""
    return shutil.get_terminal_size((default, 40)).columns


def console(stderr: bool = False, width: int | None = None):
    """A rich console as wide as the terminal (or ``width``)."""
    from rich.console import Console
    return Console(stderr=stderr, width=width or terminal_width(),
                   file=sys.stderr if stderr else None)
