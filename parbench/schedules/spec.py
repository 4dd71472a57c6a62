"""What a schedule is, beside its action lists: the metadata registered with its generator.

Every generator is decorated with :func:`schedule_spec`, which records a
:class:`ScheduleSpec` — name, description, how many chunks per rank it holds, its placement
kind, whether it is asynchronous, its closed-form bubble and the costs under which its paper
states that bubble.  ``registry.SCHEDULES`` is built from these records, so adding a
schedule means writing one decorated generator (and its test); the scheme registry
(``impls/pipeline``), the CLI, the closed-form dispatch and the tests read the spec.

    >>> from parbench.schedules import SCHEDULES
    >>> spec = SCHEDULES["zbv"]
    >>> spec.chunks, spec.placement, spec.v_for(1)
    (<ChunkRule.TWO: 'two'>, <Placement.V: 'v'>, None)
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Callable, Protocol

from .actions import Schedule, ScheduleError
from .closed_forms import ClosedForm

Generator = Callable[..., Schedule]


class ClosedFormFn(Protocol):
    """``closed_form(p, m, v, tf, tb, tw, overlap) -> ClosedForm | None`` for scalar costs."""

    def __call__(self, p: int, m: int, v: int, tf: float, tb: float, tw: float,
                 overlap: bool) -> ClosedForm | None: ...


#: ``max_inflight(p, m, rank)``: peak micro-batches in flight on ``rank`` (see closed_forms)
InflightFn = Callable[[int, int, int], int]


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

    paper_costs: the costs under which the paper states its closed form (unit costs unless
    the paper's own cost model differs); the pipeline table reports the closed form there.
    max_inflight: the paper's peak in-flight micro-batches per rank, where one is stated.
    """

    name: str
    generator: Generator
    description: str
    chunks: ChunkRule
    placement: Placement
    asynchronous: bool = False
    closed_form: ClosedFormFn | None = None
    paper_costs: Costs = UNIT_COSTS
    max_inflight: InflightFn | None = None

    def build(self, p: int, m: int, v: int | None = None, **options) -> Schedule:
        """The generator's schedule (``v=None``: its natural number of chunks)."""
        return self.generator(p, m, v, **options)

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


def schedule_spec(name: str, *, description: str, chunks: ChunkRule, placement: Placement,
                  asynchronous: bool = False, closed_form: ClosedFormFn | None = None,
                  paper_costs: Costs = UNIT_COSTS,
                  max_inflight: InflightFn | None = None) -> Callable[[Generator], Generator]:
    """Decorator: register the decorated generator under ``name`` with its metadata."""

    def attach(generator: Generator) -> Generator:
        if name in _SPECS:
            raise ValueError(f"schedule name={name!r} is registered twice")
        _SPECS[name] = ScheduleSpec(
            name=name, generator=generator, description=description, chunks=chunks,
            placement=placement, asynchronous=asynchronous, closed_form=closed_form,
            paper_costs=paper_costs, max_inflight=max_inflight)
        return generator

    return attach


def registered_specs() -> dict[str, ScheduleSpec]:
    """Every spec registered so far, in registration order."""
    return dict(_SPECS)
