"""The traffic ledger: one per process, fed by every thread (see ``parbench.comm``)."""
from __future__ import annotations

import threading
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from fractions import Fraction

import torch.distributed as dist

from ..analytic.comm import ROOTED, rooted_wire_factor, wire_factor

_LOCK = threading.Lock()
_ACTIVE: "Ledger | None" = None
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
    if op in ROOTED and root is not None:
        return rooted_wire_factor(op, n, group_rank, root) * message_bytes
    return wire_factor(op, n) * message_bytes


class Ledger:
    """The records of one rank. Use as a context manager around the code to account; while it
    is active, every thread's calls land here."""

    def __init__(self, axis_of=None, timeline=None, recording: bool = True):
        self.recording = recording  # False: entering it changes nothing (overhead baseline)
        self.records: list[CommRecord] = []
        self._exact: list[Fraction] = []  # each record's wire bytes, exact
        self._axis_of = axis_of  # callable(group) -> axis name
        self.timeline = timeline
        self._prev = None

    def __enter__(self) -> "Ledger":
        global _ACTIVE
        from .install import install
        install()
        if self.recording:
            with _LOCK:
                self._prev, _ACTIVE = _ACTIVE, self
        return self

    def __exit__(self, *exc) -> None:
        global _ACTIVE
        if self.recording:
            with _LOCK:
                _ACTIVE = self._prev

    def axis(self, group) -> str:
        if self._axis_of is not None:
            name = self._axis_of(group)
            if name:
                return name
        return "world" if group is None or group is dist.group.WORLD else "other"

    def add(self, rec: CommRecord, exact_wire: Fraction) -> None:
        with _LOCK:
            self.records.append(rec)
            self._exact.append(exact_wire)

    # ---- summaries ---------------------------------------------------------------------
    def wire_by_axis(self) -> dict[str, float]:
        """Exact per-axis sums (fractions of a byte from the ring factor are summed exactly
        before rounding to float, so equal totals compare equal)."""
        out: dict[str, Fraction] = defaultdict(Fraction)
        for r, w in zip(self.records, self._exact):
            out[r.axis] += w
        return {a: float(v) for a, v in out.items()}

    def calls_by_axis(self) -> dict[str, int]:
        """Calls per axis that move data (receives, barriers and collectives on a group of
        one rank not counted)."""
        out: dict[str, int] = defaultdict(int)
        for r in self.records:
            if r.op not in ("recv", "barrier") and r.group_size > 1:
                out[r.axis] += 1
        return dict(out)

    def as_dicts(self) -> list[dict]:
        return [asdict(r) for r in self.records]


def active() -> Ledger | None:
    return None if _PAUSED else _ACTIVE


@contextmanager
def unrecorded():
    """Traffic that is not the scheme's (checks, metrics, loss reporting): not recorded, on
    any thread, while the block runs."""
    global _PAUSED
    with _LOCK:
        _PAUSED += 1
    try:
        yield
    finally:
        with _LOCK:
            _PAUSED -= 1


def set_status_sink(sink) -> None:
    """``sink(text)`` is told which collective this process is in ("" when it leaves)."""
    global _STATUS_SINK
    _STATUS_SINK = sink



def status_sink():
    return _STATUS_SINK
