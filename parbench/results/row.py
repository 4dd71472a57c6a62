"""A case's row, grouped as the report reads it: ``RowCase``, ``Verdict``, ``Timing``,
``Memory`` (with ``ModelStates``), ``Traffic`` (with ``OpTally``), the pipeline's
``BubbleFigures`` and ``Environment``; ``Row.from_dict`` reads this format and the flat one."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from ..layout import Layout
from . import flat
from .rank import BubbleFigures, Divergence, Failure, FirstFailure, SchemeFigures

#: 2: the grouped row; files without ``format`` hold flat rows (``flat.grouped``)
ROW_FORMAT = 2
#: ``Row.analytic``: the closed forms' further figures (``Prediction.figures``: parameter
#: counts, transfers, the paper's accountings), kept for readers of the JSON; the figures
#: the report shows from it have fields (``ModelStates.paper``).
AnalyticFigures = dict[str, Any]


# ---- the row's groups --------------------------------------------------------------------


@dataclass
class RowCase:
    """Which case a row is: its scheme, its layout and its whole configuration (``config``:
    ``CaseConfig.to_dict()``: model, layout, options, run)."""

    id: str
    suite: str = ""
    scheme: str = ""
    family: str = ""
    #: the native scheme a baseline stands beside (None: a native scheme)
    baseline_of: str | None = None
    model: str = ""
    layout: Layout = field(default_factory=Layout)
    config: dict = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    def degrees(self) -> dict[str, int]:
        """tp, cp, ep, dp, pp and vpp."""
        return {**self.layout.degrees(), "vpp": self.layout.vpp}


@dataclass
class Tolerance:
    """``rtol``, ``atol``: losses and gradients; ``param_atol``: the golden trajectory.
    ``derived``: in a lower compute dtype, the rule that replaces them for the loss and
    gradients of each checked step and the final parameters (``verdict.precision``)."""

    rtol: float = 0.0
    atol: float = 0.0
    param_atol: float = 0.0
    derived: str = ""


@dataclass
class Verdict:
    """Whether the case equals the golden run, by how much, and what failed first.

    ``golden_ok``: losses, gradients and parameters within tolerance of the golden run on
    every rank and checked step, every parameter covered, and the final parameters after the
    last timed step (``final_ok``); ``update_ok``: the update check (None: the scheme has its
    own update rule); ``timed_ok``: every timed step's ledger equals its reference
    (``timed_reference``; None: no timed steps, or no traffic recorded); ``equivalent``: all
    three (issue 20: every step whose figures are reported is verified)."""

    status: str = "ok"  # ok | failed (no verdict: see ``failure``)
    failure: Failure | None = None
    equivalent: bool = False
    golden_ok: bool | None = None
    update_ok: bool | None = None
    max_loss_abs: float | None = None
    max_grad_abs: float | None = None
    max_param_abs: float | None = None
    #: the update check's largest error in units of its tolerance
    max_update_excess: float | None = None
    tolerance: Tolerance = field(default_factory=Tolerance)
    first_failure: FirstFailure | None = None
    #: golden parameters no rank reported
    uncovered: list[str] = field(default_factory=list)
    #: the smallest weight-decay error this row's comparison detects (docs/verdict.md)
    detectable_wd_error: float | None = None
    #: a bf16 row: the largest derived gradient tolerance relative to its tensor's scale --
    #: an error of that fraction of a tensor's scale is caught on every tensor and step
    detectable_grad_error: float | None = None
    #: with gradient clipping (``clip_grad``): the smallest factor the golden rule clipped a
    #: checked step's gradients by, and on how many checked steps it acted (0: the clip never
    #: acted, and the row does not test it)
    clip_coef_min: float | None = None
    clipped_steps: int | None = None
    losses: list[float | None] = field(default_factory=list)
    golden_losses: list[float] = field(default_factory=list)
    #: "live" (trained for this run) or "stored:<file>" (a committed golden file)
    golden_source: str = "live"
    #: the timed steps' ledgers (calls and wire bytes per axis, per rank) against
    #: ``timed_reference``: "the closed form" or "the last checked step's ledger"
    timed_ok: bool | None = None
    timed_reference: str = ""
    #: the final parameters after the last timed step (``verdict.final``): their largest
    #: difference from the golden rule carried over every step, and whether it is within
    #: ``param_atol``; None without timed steps
    final_ok: bool | None = None
    final_max_abs: float | None = None
    #: a lower compute dtype: the largest tolerance derived for the final parameters
    #: (``verdict.precision.final_tolerances``), which replaces ``param_atol`` there
    final_param_tol: float | None = None
    #: a failing case's first diverging module (``Divergence``; None: not localised -- the
    #: case passed, failed after its checked steps, or its scheme maps no modules)
    first_divergence: Divergence | None = None
    #: a framework baseline's disagreement already reported (``Scheme.known_finding``: what,
    #: and its reproducer), set when the row is not equivalent: the row is labelled FINDING
    #: and leaves ``run``'s exit status alone
    known_finding: str | None = None


@dataclass
class Timing:
    """``step_s``: the median timed step of the slowest rank; ``per_rank_s``: per rank, the
    seconds of each timed step (warm-up discarded; ``compare``'s noise estimate)."""

    step_s: float | None = None
    per_rank_s: list[list[float]] = field(default_factory=list)
    tokens_per_s: float | None = None
    #: the median timed step's CPU seconds of the busiest rank's process (``RankResult.
    #: step_cpu_times``)
    cpu_s: float | None = None
    #: of it, the calling thread's (the scheme's own work), the busiest rank's median; and the
    #: other threads' CPU seconds per timed step by thread name (the collective backend's),
    #: the largest rank's mean (``parbench.thread_cpu``; empty off Linux)
    own_cpu_s: float | None = None
    #: per rank, the process's and the calling thread's CPU seconds of each timed step
    #: (``per_rank_s``'s steps)
    per_rank_cpu_s: list[list[float]] = field(default_factory=list)
    per_rank_own_cpu_s: list[list[float]] = field(default_factory=list)
    threads_cpu_s: dict[str, float] = field(default_factory=dict)
    #: the verdict's share of the case's wall time: per rank, the seconds of its golden run
    #: and checks over the seconds of its part of the case (``RankResult.verdict_s`` /
    #: ``case_s``), the largest over the ranks
    verdict_share: float | None = None
    #: the slowest rank's wall seconds of its part of the case (``RankResult.case_s``)
    case_s: float | None = None


@dataclass
class ModelStates:
    """Per rank, bytes by category (params, grads, optimizer, other) after the last checked
    step: ``measured`` (the memory tracker) beside ``predicted`` (the closed form); ``exact``:
    equal on every rank and checked step (None: no prediction); ``paper``: the paper's own
    accounting of one rank (ZeRO: (2 + 2 + K) Psi, K = 12), where the scheme states one."""

    measured: list[dict[str, int] | None] = field(default_factory=list)
    predicted: list[dict[str, int]] | None = None
    exact: bool | None = None
    paper: float | None = None

    def totals(self) -> list[int | None]:
        """Per rank, the model states (what is kept only for the checks, ``checks``, aside:
        it is in the peak's other memory)."""
        return [sum(v for k, v in s.items() if k != "checks") if s else None
                for s in self.measured]

    def predicted_totals(self) -> list[int] | None:
        return None if self.predicted is None else [sum(s.values()) for s in self.predicted]


@dataclass
class Memory:
    """Peak bytes per rank (live tensor storages on CPU, ``max_memory_allocated`` on CUDA),
    the analytic peak (data-parallel family) and the model states."""

    peak_bytes: list[int | None] = field(default_factory=list)
    peak_predicted: float | None = None
    states: ModelStates = field(default_factory=ModelStates)

    def other_peak(self) -> list[int | None]:
        """Peak minus model states: activations, communication buffers, temporaries."""
        return [pk - t if pk is not None and t is not None else None
                for pk, t in zip(self.peak_bytes, self.states.totals())]


@dataclass
class OpTally:
    """One rank's calls of one op on one axis in a step, and the bytes they moved."""

    axis: str
    op: str
    count: int = 0
    message_bytes: int = 0
    wire_bytes: float = 0.0


@dataclass
class Traffic:
    """Per rank, the last checked step's wire bytes and byte-carrying calls per mesh axis,
    measured beside predicted; ``*_exact``: equal on every rank and every step the closed form
    states, checked and timed (None: no prediction, or nothing measured); ``ops``: rank 0's
    calls per axis and op."""

    wire: list[dict[str, float]] = field(default_factory=list)
    calls: list[dict[str, int]] = field(default_factory=list)
    wire_predicted: list[dict[str, float]] | None = None
    calls_predicted: list[dict[str, int]] | None = None
    wire_exact: bool | None = None
    calls_exact: bool | None = None
    ops: list[OpTally] = field(default_factory=list)

    @staticmethod
    def largest(per_rank: list[dict] | None) -> dict[str, float]:
        """The largest rank's figure per axis."""
        per = [w for w in per_rank or [] if w]
        axes = sorted({a for w in per for a in w})
        return {a: max(float(w.get(a, 0) or 0) for w in per) for a in axes}

    def wire_max(self) -> dict[str, float]:
        return self.largest(self.wire)

    def wire_predicted_max(self) -> dict[str, float] | None:
        return None if self.wire_predicted is None else self.largest(self.wire_predicted)

    def calls_max(self) -> dict[str, int]:
        return {a: int(v) for a, v in self.largest(self.calls).items()}


@dataclass
class Environment:
    """Where the row was measured, and what it wrote beside itself."""

    host_cpus: int | None = None
    torch: str = ""
    python: str = ""
    trace: str | None = None
    figures: list[str] = field(default_factory=list)


@dataclass
class Row:
    """One case: its verdict, measurements and predictions, grouped (docs/results.md)."""

    case: RowCase
    verdict: Verdict = field(default_factory=Verdict)
    time: Timing = field(default_factory=Timing)
    memory: Memory = field(default_factory=Memory)
    traffic: Traffic = field(default_factory=Traffic)
    pipeline: BubbleFigures | None = None
    scheme_figures: SchemeFigures = field(default_factory=dict)
    analytic: AnalyticFigures = field(default_factory=dict)
    env: Environment = field(default_factory=Environment)
    format: int = ROW_FORMAT

    @property
    def id(self) -> str:
        return self.case.id

    @property
    def scheme(self) -> str:
        return self.case.scheme

    @property
    def exact(self) -> bool:
        """Bytes, calls and model states equal the closed forms (where predicted)."""
        return not any(x is False for x in (self.traffic.wire_exact, self.traffic.calls_exact,
                                            self.memory.states.exact))

    @property
    def passed(self) -> bool:
        """The verdict: equivalent to the golden run and, for a native scheme, exact."""
        v = self.verdict
        return v.status == "ok" and v.equivalent and \
            (self.case.baseline_of is not None or self.exact)

    @property
    def shares_cores(self) -> bool:
        """More ranks than the host's cores: wall-clock figures include core sharing."""
        return bool(self.env.host_cpus) and self.case.world_size > self.env.host_cpus

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Row":
        """A row from its JSON object: this format (unknown keys of newer files ignored,
        missing ones at their defaults), or a flat row of an earlier version."""
        if not isinstance(d, dict):
            raise TypeError("a row is a JSON object")
        return _make(cls, flat.grouped(d) if flat.is_flat(d) else d)


#: the fields of each record that hold records: name -> class ([class]: a list of them)
_NESTED: dict[type, dict[str, Any]] = {
    Row: {"case": RowCase, "verdict": Verdict, "time": Timing, "memory": Memory,
          "traffic": Traffic, "pipeline": BubbleFigures, "env": Environment},
    RowCase: {"layout": Layout},
    Verdict: {"failure": Failure, "first_failure": FirstFailure, "tolerance": Tolerance,
              "first_divergence": Divergence},
    Memory: {"states": ModelStates},
    Traffic: {"ops": [OpTally]},
}


def _make(cls, d):
    """``cls`` from a JSON dict (None stays None); keys ``cls`` lacks are ignored."""
    if d is None or isinstance(d, cls):
        return d
    if not isinstance(d, dict):
        raise TypeError(f"{cls.__name__}: expected an object, got {type(d).__name__}")
    nested = _NESTED.get(cls, {})
    kw = {}
    for f in fields(cls):
        if f.name not in d:
            continue
        v, kind = d[f.name], nested.get(f.name)
        if isinstance(kind, list):
            v = [_make(kind[0], x) for x in v or []]
        elif kind is not None:
            v = _make(kind, v)
        kw[f.name] = v
    return cls(**kw)
