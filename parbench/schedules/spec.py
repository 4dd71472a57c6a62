"""What a schedule is, beside its action lists: the facts registered with its generator.

Every generator is decorated with :func:`schedule_spec`, which records a :class:`ScheduleSpec`
-- name, description, how many chunks per rank it holds, its placement, whether it splits the
backward, the fewest micro-batches it takes, its weight rule, which executor runs it, its
closed-form bubble, its activation memory and whether the time model prices it.
``registry.SCHEDULES`` is built from these records, and everything else -- the time model,
the planner, the scheme registry (``impls/pipeline``), the pipeline metrics, the CLI and the
tests -- reads a schedule's facts here, never off its name.

A generator produces only the per-rank compute lists (and what truly differs: notes,
overlapped pairs, token slices, as :class:`Rows`); :meth:`ScheduleSpec.build` checks the
arguments and assembles the :class:`Schedule` (placement, stages, replicas, split backward).

    >>> from parbench.schedules import SCHEDULES
    >>> spec = SCHEDULES["zbv"]
    >>> spec.chunks, spec.placement, spec.v_for(1), spec.splits_backward
    (<ChunkRule.TWO: 'two'>, <Placement.V: 'v'>, None, True)
    >>> SCHEDULES["zb-h2"].min_microbatches(4), str(SCHEDULES["zb-h2"].min_m)
    (7, '2p-1')
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Callable, Protocol

from ._arguments import need_positive, no_extra, resolve_v
from .actions import (
    Action,
    Schedule,
    ScheduleError,
    bidirectional_placement,
    linear_placement,
    looped_placement,
    split_fused,
    v_placement,
    wave_placement,
)
from .closed_forms import ClosedForm, flush_memory


class ClosedFormFn(Protocol):
    """``closed_form(p, m, v, tf, tb, tw, overlap) -> ClosedForm | None`` for scalar costs."""

    def __call__(self, p: int, m: int, v: int, tf: float, tb: float, tw: float,
                 overlap: bool) -> ClosedForm | None: ...


#: ``max_inflight(p, m, rank)``: peak micro-batches in flight on ``rank`` (see closed_forms)
InflightFn = Callable[[int, int, int], int]
#: ``memory(p, m, v, rank)``: micro-batches' worth of the rank's layers whose activations it
#: holds at its peak (what the time model multiplies one micro-batch's activations by)
MemoryFn = Callable[[int, int, int, int], float]
#: ``check(p, m, v)``: raise ScheduleError naming field, value and rule (beyond min_m)
CheckFn = Callable[[int, int, int], None]


class ChunkRule(StrEnum):
    """How many model chunks (stages of one replica) a rank holds."""

    #: one stage per rank per replica; a case must set vpp=1
    ONE = "one"
    #: always two (the V shapes: stages r and 2p-1-r); vpp=1 or vpp=2 are both accepted
    TWO = "two"
    #: any v the case asks for with vpp > 1; vpp=1 takes the generator's default
    ANY = "any"


class Placement(StrEnum):
    """Where the stages live (the functions of the same names in ``actions``)."""

    LINEAR = "linear"                # stage s on rank s
    LOOPED = "looped"                # stage s on rank s % p
    V = "v"                          # rank r holds stages r and 2p-1-r
    BIDIRECTIONAL = "bidirectional"  # two replicas: pipe 0 stage s on s, pipe 1 on p-1-s
    WAVE = "wave"                    # zig-zag: chunk c down the ranks (c even) or up (odd)

    def num_stages(self, p: int, v: int) -> int:
        """Stages of one replica: p (linear, bidirectional), 2p (V), p v (looped, wave)."""
        if self in (Placement.LINEAR, Placement.BIDIRECTIONAL):
            return p
        return 2 * p if self is Placement.V else p * v

    @property
    def pipes(self) -> int:
        """Model replicas (two for Chimera / DualPipe, whose micro-batches split half/half)."""
        return 2 if self is Placement.BIDIRECTIONAL else 1

    def ranks(self, p: int, v: int) -> dict[tuple[int, int], int]:
        """``(pipe, stage) -> rank``."""
        if self is Placement.LINEAR:
            return linear_placement(p)
        if self is Placement.LOOPED:
            return looped_placement(p, v)
        if self is Placement.V:
            return v_placement(p)
        if self is Placement.WAVE:
            return wave_placement(p, v)
        return bidirectional_placement(p)

    def mb_pipe(self, m: int) -> list[int]:
        """The replica of each micro-batch: the first half on pipe 0, the rest on pipe 1."""
        return [0] * m if self.pipes == 1 else [0] * (m // 2) + [1] * (m - m // 2)


class WeightRule(StrEnum):
    """Which weights a micro-batch runs on and when the optimizer steps (the value is the
    rule's name in ``parbench.analytic.pipeline.weight_versions``)."""

    #: a flush per step: gradients of the m micro-batches accumulated, one update
    SYNC = "sync"
    #: PipeDream (Narayanan et al. 2019): an update after every micro-batch, stashed versions
    PIPEDREAM = "pipedream"
    #: PipeDream-2BW (Narayanan et al. 2021): two versions, a one-step-delayed update
    TWO_BW = "2bw"


class ExecutorKind(StrEnum):
    """Which executor runs the schedule on real ranks (``impls/pipeline``)."""

    STANDARD = "standard"          # executor.Executor
    SEGMENTS = "segments"          # segments.SegmentExecutor: token-slice units
    BPIPE = "bpipe"                # bpipe.BPipeExecutor: plus activation evictions
    ASYNCHRONOUS = "asynchronous"  # the standard one over a continuous run (no flush)


@dataclass(frozen=True)
class MinMicrobatches:
    """The fewest micro-batches a generator takes on p ranks, ``a p + b`` (at least 1)."""

    a: int = 0
    b: int = 1

    def __call__(self, p: int) -> int:
        return max(1, self.a * p + self.b)

    def __str__(self) -> str:
        if not self.a:
            return str(self.b)
        text = f"{self.a}p" if self.a > 1 else "p"
        return text + (f"{self.b:+d}" if self.b else "")


@dataclass
class Rows:
    """What a generator returns: every rank's compute actions, and what differs by schedule
    (free-text notes, DualPipe's overlapped pairs, token slices per micro-batch)."""

    actions: list[list[Action]]
    notes: str = ""
    overlapped: list[tuple[Action, Action]] = field(default_factory=list)
    segments: int = 1


#: ``generator(p, m, v, **options) -> Rows`` (or the bare per-rank lists)
Generator = Callable[..., "Rows | list[list[Action]]"]


@dataclass(frozen=True, kw_only=True)
class Costs:
    """Scalar per-op costs for the simulator and the closed forms (a fused BW costs tb + tw);
    ``overlap`` runs DualPipe's F&B pairs as one unit."""

    tf: float = 1.0
    tb: float = 1.0
    tw: float = 1.0
    overlap: bool = False

    def as_kwargs(self) -> dict:
        """Keyword arguments for ``simulate`` and for a spec's closed form."""
        return {"tf": self.tf, "tb": self.tb, "tw": self.tw, "overlap": self.overlap}


#: T_F = T_B = T_W = 1 (a fused backward costs 2): the default of the simulator
UNIT_COSTS = Costs()


@dataclass(frozen=True, kw_only=True)
class ScheduleSpec:
    """One schedule: its generator and the facts the rest of parbench needs about it.

    splits_backward: the generator emits separate B and W passes (the time model prices W
    apart); can_split: it takes ``split_backward=True`` (B then W instead of each BW);
    min_m: the fewest micro-batches it takes (``min_microbatches(p)``); check: its further
    argument rules; options: the keyword options it takes beyond p, m, v; weight_rule and
    executor: how it runs on real ranks; memory: micro-batches of activations of a rank's
    layers at its peak, the paper's rule (the time model's memory) and memory_note, the
    paper's statement in words (the pipeline table prints it); paper_costs: the costs under
    which the paper states its closed form; max_inflight: the paper's peak in-flight
    micro-batches per rank, where one is stated; unpriced: why the time model and the
    planner cannot price it (empty: they do).
    """

    name: str
    generator: Generator
    description: str
    chunks: ChunkRule
    placement: Placement
    splits_backward: bool = False
    can_split: bool = False
    min_m: MinMicrobatches = MinMicrobatches()
    min_chunks: int = 2
    check: CheckFn | None = None
    options: tuple[str, ...] = ()
    weight_rule: WeightRule = WeightRule.SYNC
    executor: ExecutorKind = ExecutorKind.STANDARD
    memory: MemoryFn = flush_memory
    memory_note: str = ""
    closed_form: ClosedFormFn | None = None
    paper_costs: Costs = UNIT_COSTS
    max_inflight: InflightFn | None = None
    unpriced: str = ""

    @property
    def asynchronous(self) -> bool:
        """No flush between steps: the weights a micro-batch runs on are stale."""
        return self.weight_rule is not WeightRule.SYNC

    @property
    def takes_uneven_stages(self) -> bool:
        """Whether an uneven first / last pipeline rank (``Layout.first_stage_layers``) has a
        meaning: stage s on rank s, or looped (s on s % p) as Megatron-Core places chunks;
        a V, wave or two-pipe placement puts other stages on the first and last ranks."""
        return self.placement in (Placement.LINEAR, Placement.LOOPED)

    @property
    def priced(self) -> bool:
        """Whether the time model prices it (and the planner searches it)."""
        return not self.unpriced

    def min_microbatches(self, p: int) -> int:
        """The fewest micro-batches the generator takes on p ranks."""
        return self.min_m(p)

    def refusal(self, p: int, m: int, v: int | None = None) -> str | None:
        """Why the generator refuses (p, m, v), from the rules stated here; None: it builds."""
        try:
            self._check(p, m, self.resolve_v(v))
        except ScheduleError as e:
            return str(e)
        return None

    def resolve_v(self, v: int | None) -> int:
        """The generator's v (None: its natural number of chunks per rank)."""
        if self.chunks is ChunkRule.ONE:
            return resolve_v(self.name, v, 1, allowed=(1,))
        if self.chunks is ChunkRule.TWO:
            return resolve_v(self.name, v, 2, allowed=(2,))
        return resolve_v(self.name, v, 2, minimum=self.min_chunks)

    def _check(self, p: int, m: int, v: int) -> None:
        need_positive(self.name, p=p, m=m)
        least = self.min_m(p)
        if m < least:
            raise ScheduleError(f"{self.name} needs m >= {self.min_m} = {least} "
                                f"(got m={m}, p={p})")
        if self.check is not None:
            self.check(p, m, v)

    def build(self, p: int, m: int, v: int | None = None, *, split_backward: bool = False,
              **options) -> Schedule:
        """The generator's schedule (``v=None``: its natural number of chunks)."""
        need_positive(self.name, p=p, m=m)
        v = self.resolve_v(v)
        no_extra(self.name, {k: x for k, x in options.items() if k not in self.options})
        if split_backward and not self.can_split:
            raise ScheduleError(f"{self.name} takes no option split_backward=True (it runs "
                                f"{'split' if self.splits_backward else 'fused'} backwards)")
        self._check(p, m, v)
        rows = self.generator(p, m, v, **options)
        if not isinstance(rows, Rows):
            rows = Rows(rows)
        actions = [split_fused(r) for r in rows.actions] if split_backward else rows.actions
        units = m * rows.segments
        return Schedule(
            name=self.name, p=p, m=units, v=v, num_stages=self.placement.num_stages(p, v),
            placement=self.placement.ranks(p, v), mb_pipe=self.placement.mb_pipe(units),
            actions=actions, split_backward=self.splits_backward or bool(split_backward),
            asynchronous=self.asynchronous, overlapped=rows.overlapped, notes=rows.notes,
            segments=rows.segments)

    def v_for(self, vpp: int) -> int | None:
        """The generator's ``v`` for a case's ``vpp`` (None: the generator's default).

        Raises ScheduleError naming vpp and the rule when the schedule cannot hold that many
        chunks per rank.
        """
        if self.chunks is ChunkRule.TWO:
            if vpp not in (1, 2):
                raise ScheduleError(f"vpp={vpp}: {self.name} always holds 2 stages per rank "
                                    "(use vpp=1 or vpp=2)")
            return None
        if self.chunks is ChunkRule.ANY:
            return vpp if vpp > 1 else None
        if vpp != 1:
            raise ScheduleError(f"vpp={vpp}: {self.name} holds one stage per rank per "
                                "replica (set vpp=1)")
        return None

    def chunks_for(self, vpp: int) -> int:
        """Stages per rank per replica for a case's ``vpp``, as a number: 1 (ONE), 2 (TWO),
        vpp or the looped generators' default 2 (ANY). What the analytic figures take."""
        v = self.v_for(vpp)
        if v is not None:
            return v
        return 1 if self.chunks is ChunkRule.ONE else 2


_SPECS: dict[str, ScheduleSpec] = {}


def schedule_spec(name: str, **facts) -> Callable[[Generator], Callable[..., Schedule]]:
    """Decorator: register the decorated generator under ``name`` with its facts (the
    fields of :class:`ScheduleSpec`); the decorated name becomes the spec's ``build``."""

    def attach(generator: Generator) -> Callable[..., Schedule]:
        if name in _SPECS:
            raise ValueError(f"schedule name={name!r} is registered twice")
        spec = _SPECS[name] = ScheduleSpec(name=name, generator=generator, **facts)

        def build(p: int, m: int, v: int | None = None, **options) -> Schedule:
            return spec.build(p, m, v, **options)

        build.__doc__, build.__name__ = generator.__doc__, generator.__name__
        build.rows = generator  # the bare generator (per-rank lists)
        return build

    return attach


def registered_specs() -> dict[str, ScheduleSpec]:
    """Every spec registered so far, in registration order."""
    return dict(_SPECS)
