"""What the wrappers (``install``) and the ledger share: the record of one call, its exact
wire bytes, and the process-wide recording state -- which ledger is active, whether
recording is paused, and the status sink the launcher reads."""
from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache

from ..analytic.comm import ROOTED, rooted_wire_factor, wire_factor

LOCK = threading.Lock()
_ACTIVE = None  # the active Ledger
_PAUSED = 0
#: called with a one-line description when a rank enters a collective and with "" when it
#: leaves (the launcher shows it when a case hangs)
_STATUS_SINK = None


@dataclass
class CommRecord:
    op: str
    axis: str
    group_size: int
    dtype: str
    elements: int
    message_bytes: int
    wire_bytes: float
    peer: int = -1
    start: float = 0.0
    end: float = 0.0
    async_op: bool = False
    thread: str = ""
    api: str = "c10d"  # c10d | functional


def record_wire(op: str, message_bytes: int, n: int, group_rank: int = 0,
                root: int | None = None) -> Fraction:
    """Bytes one rank sends for one recorded call, exact (``analytic.comm``)."""
    return wire_pair(op, message_bytes, n, group_rank, root)[0]


@lru_cache(maxsize=8192)
def wire_pair(op: str, message_bytes: int, n: int, group_rank: int = 0,
              root: int | None = None) -> tuple[Fraction, float]:
    """``record_wire`` and its float: a pure function of its arguments, cached (a step
    repeats the same calls; hashing a Fraction or taking its float costs microseconds)."""
    if op in ROOTED and root is not None:
        wire = rooted_wire_factor(op, n, group_rank, root) * message_bytes
    else:
        wire = wire_factor(op, n) * message_bytes
    return wire, float(wire)


def activate(ledger):
    """Make ``ledger`` the one every thread's calls land in; returns the one it replaces."""
    global _ACTIVE
    with LOCK:
        previous, _ACTIVE = _ACTIVE, ledger
    return previous


def restore(previous) -> None:
    """Make ``previous`` (``activate``'s answer) the active ledger again."""
    global _ACTIVE
    with LOCK:
        _ACTIVE = previous


def active():
    """The ledger calls are recorded in now (None: none, or paused)."""
    return None if _PAUSED else _ACTIVE


@contextmanager
def unrecorded():
    """Traffic that is not the scheme's (checks, metrics, loss reporting): not recorded, on
    any thread, while the block runs."""
    global _PAUSED
    with LOCK:
        _PAUSED += 1
    try:
        yield
    finally:
        with LOCK:
            _PAUSED -= 1


def set_status_sink(sink) -> None:
    """``sink(text)`` is told which collective this process is in ("" when it leaves)."""
    global _STATUS_SINK
    _STATUS_SINK = sink


def status_sink():
    return _STATUS_SINK
