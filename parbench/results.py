"""Typed results, from the rank to the report: a step's check, a rank's result, a case's row.

``Row`` is the README's schema in code: one JSON object per finished (or failed) case,
appended to ``results.jsonl`` and flushed as soon as the case ends. Rows are read back with
``load_rows`` (unknown keys of newer files are ignored, missing ones take their defaults).
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path


@dataclass
class StepCheck:
    """One checked step on one rank: what it holds against the golden run."""

    step: int
    grad_max_abs: float
    grad_ok: bool
    param_max_abs: float
    param_ok: bool
    names: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    loss: float | None = None
    golden_loss: float | None = None
    loss_abs: float | None = None
    loss_ok: bool | None = None
    #: the update check (``checks.UpdateCheck``): largest error in units of its tolerance
    update_excess: float | None = None
    update_ok: bool | None = None
    #: loss and gradients held against the stepwise golden (the golden model at the scheme's
    #: own weights); param_max_abs is then the drift from the golden trajectory
    stepwise: bool = False
    #: step 0 only: the scheme's initial parameters equal the golden initialisation
    init_ok: bool | None = None
    init_max_abs: float | None = None
    #: the first failing check of this step on this rank: what (loss, gradient, parameter,
    #: update, init, missing), tensor, max_abs, tolerance; None when every check passed
    failure: dict | None = None


@dataclass
class RankResult:
    """Everything one rank measured for one case."""

    rank: int
    losses: list[float | None]
    checks: list[StepCheck]
    step_times: list[float]
    peak_bytes: int | None
    #: model states live after each checked step, attributed by the tracker
    #: (``memory.live_model_states``); ``model_state_bytes`` is the last checked step's
    model_states_per_step: list[dict[str, int]]
    #: per step (checked and timed), this rank's wire bytes and byte-carrying calls per axis
    wire_by_axis_per_step: list[dict[str, float]]
    calls_by_axis_per_step: list[dict[str, int]]
    #: the ledger records and timeline events of the last checked step
    ledger: list[dict]
    timeline: list[dict]
    metrics: dict = field(default_factory=dict)

    @property
    def model_state_bytes(self) -> dict[str, int] | None:
        return self.model_states_per_step[-1] if self.model_states_per_step else None


@dataclass
class Failure:
    """Why a case has no verdict: the rank that failed and its traceback."""

    kind: str  # "crashed" | "hung" | "timeout"
    rank: int
    message: str
    traceback: str = ""


@dataclass
class Row:
    """One case: its verdict, measurements and predictions (see the README's table)."""

    id: str
    suite: str
    scheme: str
    family: str
    baseline_of: str | None
    world_size: int
    degrees: dict[str, int]
    model: str
    case: dict
    status: str = "ok"  # ok | failed (no verdict: see ``failure``)
    failure: Failure | None = None
    #: golden_ok and update_ok; golden_ok: losses, gradients and parameters within tolerance
    #: of the golden run; update_ok: the update check (``checks.UpdateCheck``)
    equivalent: bool = False
    golden_ok: bool | None = None
    update_ok: bool | None = None
    max_loss_abs: float | None = None
    max_grad_abs: float | None = None
    max_param_abs: float | None = None
    tolerance: dict = field(default_factory=dict)
    uncovered: list[str] = field(default_factory=list)
    #: the earliest failing check: step, rank, what, tensor, max_abs, tolerance
    first_failure: dict | None = None
    losses: list = field(default_factory=list)
    golden_losses: list = field(default_factory=list)
    #: "live" (trained for this run) or "stored:<file>" (a committed golden file)
    golden_source: str = "live"
    step_time_s: float | None = None
    #: per rank, the seconds of each timed step (warm-up discarded); ``parbench compare``
    #: takes its noise threshold from their spread (absent from files written before it)
    step_times_s: list = field(default_factory=list)
    tokens_per_s: float | None = None
    peak_bytes: list = field(default_factory=list)
    peak_bytes_predicted: float | None = None
    other_peak_bytes: list = field(default_factory=list)
    model_state_bytes: list = field(default_factory=list)
    model_state_bytes_predicted: list | None = None
    wire_bytes: dict[str, float] = field(default_factory=dict)
    wire_bytes_per_rank: list = field(default_factory=list)
    wire_bytes_predicted: dict[str, float] | None = None
    wire_bytes_predicted_per_rank: list | None = None
    #: every rank's measured figure equals its prediction on every checked step (None: no
    #: prediction). Part of a native scheme's verdict; a baseline's difference is a finding.
    wire_exact: bool | None = None
    calls_exact: bool | None = None
    model_state_exact: bool | None = None
    calls_per_rank: list = field(default_factory=list)
    calls_predicted_per_rank: list | None = None
    #: the update check's largest error in units of its tolerance, and the smallest
    #: weight-decay error the comparison detects (see the README's "Tolerances")
    max_update_excess: float | None = None
    detectable_wd_error: float | None = None
    prediction: dict = field(default_factory=dict)
    ledger_summary: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)
    figures: list[str] = field(default_factory=list)
    trace: str | None = None
    host_cpus: int | None = None
    torch: str = ""
    python: str = ""

    @property
    def exact(self) -> bool:
        """Bytes, calls and model states equal the closed forms (where predicted)."""
        return not any(x is False for x in (self.wire_exact, self.calls_exact,
                                            self.model_state_exact))

    @property
    def passed(self) -> bool:
        """The verdict: equivalent to the golden run and, for a native scheme, exact."""
        return self.status == "ok" and self.equivalent and \
            (self.baseline_of is not None or self.exact)

    @property
    def shares_cores(self) -> bool:
        """More ranks than the host's cores: wall-clock figures include core sharing."""
        return bool(self.host_cpus) and self.world_size > self.host_cpus

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Row":
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in known}
        if isinstance(kw.get("failure"), dict):
            kw["failure"] = Failure(**kw["failure"])
        return cls(**kw)


def append_row(path: Path | str, row: Row) -> None:
    """Append one JSON line and flush it to disk, so an interrupted suite keeps it."""
    with open(path, "a") as fh:
        fh.write(json.dumps(row.to_dict(), sort_keys=True, default=_default) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def _default(o):
    if hasattr(o, "item"):
        return o.item()
    return str(o)


def load_rows(path: Path | str) -> list[Row]:
    """Rows of a results file or directory (a truncated last line from a killed run is
    skipped)."""
    p = Path(path)
    if p.is_dir():
        p = p / "results.jsonl"
    rows: list[Row] = []
    if not p.exists():
        return rows
    with open(p) as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(Row.from_dict(json.loads(line)))
            except (json.JSONDecodeError, TypeError):
                continue
    return rows


def to_frame(rows: list[Row]):
    """Flatten rows into a pandas DataFrame (one row per case)."""
    import pandas as pd
    flat = []
    for r in rows:
        f = {k: v for k, v in r.to_dict().items() if not isinstance(v, (dict, list))}
        for a, v in r.wire_bytes.items():
            f[f"wire_{a}"] = v
        for a, v in (r.wire_bytes_predicted or {}).items():
            f[f"wire_{a}_predicted"] = v
        peaks = [x for x in r.peak_bytes if x is not None]
        f["peak_bytes_max"] = max(peaks) if peaks else None
        for k, v in r.extra.items():
            if not isinstance(v, (dict, list)):
                f[k] = v
        flat.append(f)
    return pd.DataFrame(flat)
