"""What one rank returns for a case (``RankResult``), and the figures that travel from the
rank to the row: a check's ``FirstFailure`` and a pipeline's ``BubbleFigures``."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

#: ``RankResult.metrics`` and ``Row.scheme_figures``: a scheme's own figures
#: (``Scheme.metrics()``, the bubble figures apart; in the row, each key as the lowest rank
#: reporting it gives it): name -> number, string or list, e.g. ``moe_load_imbalance``,
#: ``bpipe``. The report shows each scalar as a column of the wide table; no module of
#: parbench reads a key.
SchemeFigures = dict[str, Any]
#: ``BubbleFigures.detail``: makespans, per-rank ratios, held graphs and in-flight counts,
#: p2p latency, the closed form's formula and costs, and schedule-specific figures
#: (``impls/pipeline/metrics.py`` documents each key); tests read it, the report does not.
BubbleDetail = dict[str, Any]


# ---- what failed -------------------------------------------------------------------------

#: ``FirstFailure.what`` of a timed step whose ledger left its reference (the closed form, or
#: the checked steps' ledger): ``verdict.timed``
LEDGER_FAILURES = ("wire bytes", "calls")


@dataclass
class FirstFailure:
    """The earliest failing check of a case: where (step, rank; None before the ranks are
    merged), what (loss, gradient, parameter, state, update, init, missing, uncovered, final
    parameters; or a timed step's ``wire bytes`` / ``calls`` on the axis ``tensor``), the
    tensor, its largest difference and the tolerance it broke (a ledger's: ``measured``
    beside ``expected``). ``str()`` is the one line users read."""

    what: str
    tensor: str = ""
    max_abs: float | None = None
    tolerance: float | None = None
    detail: str = ""
    step: int | None = None
    rank: int | None = None
    measured: float | None = None
    expected: float | None = None
    #: where the case first diverges, module by module (``Divergence``, issue 20 sec. 5; ""
    #: when not localised): appended to the line
    divergence: str = ""

    def at(self, step: int, rank: int) -> "FirstFailure":
        return replace(self, step=step, rank=rank)

    def __str__(self) -> str:
        where = f"step {self.step}, rank {self.rank}: " if self.step is not None else ""
        tensor, what = self.tensor, self.what
        if what in LEDGER_FAILURES:
            return where + (f"{what} on {tensor}: {self.measured:.6g} measured, "
                            f"{self.expected:.6g} expected ({self.detail})")
        return where + self._text() + (f"; first divergence: {self.divergence}"
                                       if self.divergence else "")

    def _text(self) -> str:
        tensor, what = self.tensor, self.what
        text = f"{what} {tensor!r}" if tensor and tensor != what else what
        if what == "update" and self.max_abs is not None:
            text += (f": the step is {self.max_abs:.3g} x its tolerance off the run's "
                     "optimizer applied to the reported gradients")
        elif self.max_abs is not None:
            text += f": max|ours - golden| = {self.max_abs:.3g}"
            if self.tolerance is not None:
                text += f" > tolerance {self.tolerance:.3g}"
        if what in ("gradient", "parameter") and not tensor:
            text += " (this parbench version does not record which tensor)"
        if self.detail and what != "update":
            text += f" ({self.detail})"
        return text


@dataclass
class Divergence:
    """The first module whose forward output or input gradient leaves the golden run's, at
    the scheme's own weights (``parbench.verdict.divergence``): forward outputs in the
    reference model's forward order first, then input gradients in backward order; the
    earliest step, then the lowest rank. ``where`` "none": every mapped module agrees (the
    difference arises after backward: the gradients' reduction or the optimizer)."""

    where: str  # "forward output" | "input gradient" | "none"
    module: str = ""
    step: int | None = None
    rank: int | None = None
    max_abs: float | None = None
    tolerance: float | None = None

    def __str__(self) -> str:
        if self.where == "none":
            return ("none in the mapped modules: every forward output and input gradient "
                    "equals the golden run's (the difference arises after backward: the "
                    "gradients' reduction or the optimizer)")
        text = f"{self.where} of {self.module} (rank {self.rank}, step {self.step})"
        if self.max_abs is not None and self.tolerance is not None:
            text += f": max|ours - golden| = {self.max_abs:.3g} > tolerance {self.tolerance:.3g}"
        return text


@dataclass
class Failure:
    """Why a case has no verdict: the rank that failed and its traceback."""

    kind: str  # "crashed" | "hung" | "timeout"
    rank: int
    message: str
    traceback: str = ""


# ---- one rank ----------------------------------------------------------------------------


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
    #: the update check (``verdict.checks.UpdateCheck``): largest error in units of its
    #: tolerance
    update_excess: float | None = None
    update_ok: bool | None = None
    #: loss and gradients held against the stepwise golden (the golden model at the scheme's
    #: own weights); param_max_abs is then the drift from the golden trajectory
    stepwise: bool = False
    #: a lower compute dtype's derived tolerances (``verdict.precision``): the largest
    #: tolerance relative to its tensor's scale this step (None: fp32, stated tolerances)
    detectable_grad_error: float | None = None
    #: the final check of a lower compute dtype (``verdict.final``): the largest derived
    #: tolerance of any parameter (None: the stated ``param_atol``)
    param_tol: float | None = None
    #: with gradient clipping (``clip_grad``): the reference's global gradient norm before
    #: clipping, and the factor the step's gradients were clipped by (1: the norm was under
    #: the threshold, the clip did not act and the step says nothing about it)
    grad_norm: float | None = None
    clip_coef: float | None = None
    #: the model state beside the parameters (the routers' balancing biases,
    #: ``Scheme.full_state``) against the stepwise golden's update (None: no state)
    state_max_abs: float | None = None
    state_ok: bool | None = None
    #: step 0 only: the scheme's initial parameters equal the golden initialisation
    init_ok: bool | None = None
    init_max_abs: float | None = None
    #: the first failing check of this step on this rank (no step or rank yet); None when
    #: every check passed
    failure: FirstFailure | None = None


@dataclass
class BubbleFigures:
    """A pipeline case's bubble ratios side by side (DESIGN.md, "Timeline"): ``measured``
    (wall clock), ``replayed`` (the simulator with every action's measured cost),
    ``sim_mean_costs`` (the simulator with one mean cost per kind and stage), ``unit`` (the
    simulator with unit costs) and ``closed_form`` (the paper's formula, where it is exact for
    the schedule). ``schedule`` and ``held_graphs`` are the report's lines for the schedule
    and the graphs each rank held; ``activation_peak_bytes`` is per rank."""

    schedule: str = ""
    measured: float | None = None
    replayed: float | None = None
    sim_mean_costs: float | None = None
    unit: float | None = None
    closed_form: float | None = None
    held_graphs: str = ""
    activation_peak_bytes: list[int] = field(default_factory=list)
    detail: BubbleDetail = field(default_factory=dict)

    def ratios(self) -> tuple[float | None, ...]:
        """Measured, replayed, simulated (mean costs), unit, closed form: the report's order."""
        return (self.measured, self.replayed, self.sim_mean_costs, self.unit, self.closed_form)


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
    #: the scheme's own figures (``SchemeFigures``), its bubble figures apart
    metrics: SchemeFigures = field(default_factory=dict)
    bubble: BubbleFigures | None = None
    #: the final parameters after the last timed step against the golden rule over every
    #: step (``verdict.final``); None without timed steps
    final: StepCheck | None = None
    #: per timed step after the warm-up, the CPU seconds of this rank's process (every
    #: thread; ``time.process_time``): unlike ``step_times``, hardly moved by other processes
    #: sharing the cores, so ``scripts/bench_overhead.py`` compares instrumentation on and off
    #: with it
    step_cpu_times: list[float] = field(default_factory=list)
    #: per timed step, of them, the calling thread's (the scheme's own work;
    #: ``parbench.thread_cpu``); and the other threads' CPU seconds per timed step by thread
    #: name, a mean over the timed steps (the collective backend's; Linux only)
    step_own_cpu_times: list[float] = field(default_factory=list)
    threads_cpu_s: dict[str, float] = field(default_factory=dict)
    #: wall seconds of this rank's part of the case (``harness.run_case``, scheme built to
    #: figures returned) and, of them, the verdict's: its golden run, every checked step's
    #: checks and the final check (issue 24: the verdict's share of a case)
    case_s: float = 0.0
    verdict_s: float = 0.0

    @property
    def model_state_bytes(self) -> dict[str, int] | None:
        return self.model_states_per_step[-1] if self.model_states_per_step else None
