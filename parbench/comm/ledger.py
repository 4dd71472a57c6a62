"""The traffic ledger: one per process, fed by every thread (see ``parbench.comm``)."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict
from fractions import Fraction

import torch.distributed as dist

from .install import build, install
from .recording import LOCK, CommRecord, activate, restore


class Ledger:
    """The records of one rank. Use as a context manager around the code to account; while it
    is active, every thread's calls land here."""

    def __init__(self, axis_of=None, timeline=None, recording: bool = True):
        self.recording = recording  # False: entering it changes nothing (overhead baseline)
        self._records: list[CommRecord] = []
        self._exact: list[Fraction] = []  # each record's wire bytes, exact
        self._raw: list[tuple] = []  # calls noted in a step, not yet built (install._record)
        self._axis_of = axis_of  # callable(group) -> axis name
        self.timeline = timeline
        self._prev = None

    def __enter__(self) -> "Ledger":
        install()
        if self.recording:
            self._prev = activate(self)
        return self

    def __exit__(self, *exc) -> None:
        if self.recording:
            restore(self._prev)

    def axis(self, group) -> str:
        if self._axis_of is not None:
            name = self._axis_of(group)
            if name:
                return name
        return "world" if group is None or group is dist.group.WORLD else "other"

    def add(self, rec: CommRecord, exact_wire: Fraction) -> None:
        with LOCK:
            self._flush()
            self._records.append(rec)
            self._exact.append(exact_wire)

    def add_raw(self, raw: tuple) -> None:
        """One call's facts, built into its record when the records are read."""
        with LOCK:
            self._raw.append(raw)

    def _flush(self) -> None:
        if self._raw:
            raw, self._raw = self._raw, []
            for r in raw:
                rec, wire = build(r, self.axis)
                self._records.append(rec)
                self._exact.append(wire)

    @property
    def records(self) -> list[CommRecord]:
        """Every call recorded so far, in order."""
        with LOCK:
            self._flush()
        return self._records

    def clear(self) -> None:
        with LOCK:
            self._raw, self._records, self._exact = [], [], []

    # ---- summaries ---------------------------------------------------------------------
    def wire_by_axis(self) -> dict[str, float]:
        """Exact per-axis sums (fractions of a byte from the ring factor are summed exactly
        before rounding to float, so equal totals compare equal)."""
        out: dict[str, Fraction] = defaultdict(Fraction)
        records = self.records
        for r, w in zip(records, self._exact):
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
