"""Pipeline schedules as data: actions, transfers and the `Schedule` container.

A schedule is a per-rank, ordered list of compute actions.  Everything else the
harness needs — the cross-rank transfers and their lowering into the lists (``lower``),
the dependency graph, the simulated timeline, the grid picture — is derived from that
list, so adding a schedule means writing one generator that returns the per-rank lists,
registered with its facts (``spec.schedule_spec``), which builds the `Schedule`.

Dependency rules (shared by the validator, the simulator and the executor):

* ``F(mb, s)`` needs ``F(mb, s-1)`` (stage 0 needs nothing);
* the backward-for-inputs of ``(mb, s)`` — a ``B`` or a fused ``BW`` — needs
  ``F(mb, s)`` and the backward-for-inputs of ``(mb, s+1)`` (the last stage
  needs only its own forward);
* ``W(mb, s)`` needs ``B(mb, s)``, which lives on the same rank;
* with token slices (``Schedule.segments`` > 1: Seq1F1B, TeraPipe, see ``segments``), F of
  slice j needs F of slice j-1 on the same stage and the backward of slice j-1 that of
  slice j -- same-rank dependencies, kept by the rank order the validator checks.

Stages are global model stages ``0..S-1`` of one model replica; bidirectional
schedules (Chimera, DualPipe) hold two replicas, told apart by ``pipe``, and each
micro-batch travels through exactly one of them (``Schedule.mb_pipe``).

Action kinds are :class:`ActionKind` members: the four compute kinds, and the four
point-to-point kinds that ``lower.lower`` inserts between them (a generator never emits those).
An action round-trips through text -- ``str(Action.from_str("BW3s5p1")) == "BW3s5p1"`` -- so
a test or a suite can state a schedule as text (``parse_row``, ``Schedule.text``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Iterable, Iterator


class ActionKind(StrEnum):
    """What an action does. Members compare and hash as their text (``"F" == FORWARD``).

    Compute: ``F`` forward, ``B`` backward for inputs, ``W`` backward for weights, ``BW``
    fused backward. Point-to-point (``lower``): ``SF`` sends the output activation of F(mb, s)
    to the rank of stage s+1, ``RF`` receives the input activation of F(mb, s) from the rank
    of stage s-1; ``SB`` sends the input gradient of the backward of (mb, s) to the rank of
    stage s-1, ``RB`` receives the output gradient of the backward of (mb, s) from the rank
    of stage s+1. So SF(mb, s) matches RF(mb, s+1) and SB(mb, s) matches RB(mb, s-1).
    """

    FORWARD = "F"
    BACKWARD_INPUT = "B"
    BACKWARD_WEIGHT = "W"
    BACKWARD_FULL = "BW"
    SEND_F = "SF"
    RECV_F = "RF"
    SEND_B = "SB"
    RECV_B = "RB"

    @property
    def is_p2p(self) -> bool:
        return self in _P2P

    @property
    def is_send(self) -> bool:
        return self is ActionKind.SEND_F or self is ActionKind.SEND_B


FORWARD = ActionKind.FORWARD
BACKWARD_INPUT = ActionKind.BACKWARD_INPUT
BACKWARD_WEIGHT = ActionKind.BACKWARD_WEIGHT
BACKWARD_FULL = ActionKind.BACKWARD_FULL
SEND_F, RECV_F = ActionKind.SEND_F, ActionKind.RECV_F
SEND_B, RECV_B = ActionKind.SEND_B, ActionKind.RECV_B
#: the compute kinds (what a generator emits and the validator accepts)
KINDS = (FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, BACKWARD_FULL)
#: the point-to-point kinds (what ``lower`` inserts)
P2P_KINDS = (SEND_F, RECV_F, SEND_B, RECV_B)
_P2P = frozenset(P2P_KINDS)
#: kinds that carry the gradient to the previous stage (backward-for-inputs)
INPUT_GRAD_KINDS = (BACKWARD_INPUT, BACKWARD_FULL)
#: an action's text: kind, micro-batch, 's' stage, optional 'p' pipe ('F3s0', 'RB2s1p1')
_TEXT = re.compile(r"(BW|SF|RF|SB|RB|F|B|W)(\d+)s(\d+)(?:p(\d+))?")


class ScheduleError(ValueError):
    """A schedule cannot be built or is broken; the message names field, value and rule."""


_set_field = object.__setattr__


@dataclass(frozen=True, init=False)
class Action:
    """One compute action on one rank.

    kind: an :class:`ActionKind` -- ``'F'`` forward, ``'B'`` backward for inputs, ``'W'``
    backward for weights, ``'BW'`` fused full backward (B and W together), or one of the
    point-to-point kinds ``lower`` inserts (``'SF'``, ``'RF'``, ``'SB'``, ``'RB'``).
    mb: global micro-batch index ``0..m-1``.
    stage: global model stage ``0..S-1`` (stage 0 holds the embedding, ``S-1`` the loss).
    pipe: model replica (0, or 1 for the second replica of a bidirectional schedule).
    """

    kind: str
    mb: int
    stage: int
    pipe: int = 0

    def __init__(self, kind: str, mb: int, stage: int, pipe: int = 0):
        # What the dataclass writes for a frozen class, with `object.__setattr__` looked up
        # once, at import (schedules hold hundreds of thousands of actions).
        _set_field(self, "kind", kind)
        _set_field(self, "mb", mb)
        _set_field(self, "stage", stage)
        _set_field(self, "pipe", pipe)

    def __str__(self) -> str:
        # Compact and unambiguous: 'F3s0', 'BW3s5', 'B2s1p1'. `Schedule.label`
        # gives the shorter paper-style label ('F3', 'F3c1') for a known schedule.
        text = f"{self.kind}{self.mb}s{self.stage}"
        return text + (f"p{self.pipe}" if self.pipe else "")

    @classmethod
    def from_str(cls, text: str) -> "Action":
        """The action ``str(action)`` wrote ('F3s0', 'BW3s5', 'B2s1p1', 'SF0s1');
        ScheduleError naming the text and the form otherwise."""
        found = _TEXT.fullmatch(text.strip())
        if found is None:
            raise ScheduleError(f"action={text!r} is not KIND MB s STAGE [p PIPE] (e.g. 'F3s0', "
                                f"'BW3s5p1'; kinds {', '.join(ActionKind)})")
        kind, mb, stage, pipe = found.groups()
        return cls(ActionKind(kind), int(mb), int(stage), int(pipe or 0))


def parse_row(text: str) -> list[Action]:
    """One rank's actions from text, separated by spaces or commas ('F0s0 F1s0 BW0s0')."""
    return [Action.from_str(t) for t in re.split(r"[\s,]+", text.strip()) if t]


def row_text(row: Iterable[Action]) -> str:
    """One rank's actions as the text ``parse_row`` reads."""
    return " ".join(map(str, row))


@dataclass(frozen=True, kw_only=True)
class P2PTransfer:
    """A point-to-point transfer implied by a cross-rank dependency.

    kind ``'act'``: the output activation of ``F(mb, src_stage)`` sent to
    ``F(mb, dst_stage)`` (``dst_stage = src_stage + 1``); kind ``'grad'``: the
    input gradient produced by the B/BW of ``(mb, src_stage)`` sent to the B/BW of
    ``(mb, dst_stage)`` (``dst_stage = src_stage - 1``).
    """

    kind: str
    mb: int
    src_stage: int
    dst_stage: int
    pipe: int
    src_rank: int
    dst_rank: int


@dataclass(kw_only=True)
class Schedule:
    """A pipeline schedule: per-rank ordered compute actions plus placement.

    p: ranks; m: micro-batches; v: stages per rank per replica (chunks);
    num_stages: S (``p*v`` for single-replica schedules, ``p`` for the two replicas
    of Chimera / DualPipe); placement: ``(pipe, stage) -> rank``; mb_pipe: replica
    of each micro-batch; split_backward: True when the schedule contains separate
    B and W actions (schedules may mix B+W and fused BW, e.g. DualPipe);
    asynchronous: True for PipeDream / PipeDream-2BW (no flush; stale weights).
    overlapped: optional ``(F, backward)`` pairs, adjacent on one rank, that the
    schedule runs as one overlapped unit (DualPipe's F&B chunks); executors may
    ignore it and run them in list order, ``simulate(..., overlap=True)`` uses it.
    done_before: actions finished before this schedule starts (a window of a longer
    run, such as one steady step of a continuous pipeline: ``continuous.steady_step``);
    the simulator treats them as done at time 0. Empty for a whole schedule, which
    the validator requires.
    notes: free text for reports.
    segments: token slices per micro-batch (Seq1F1B, TeraPipe: ``segments``); above 1 an
    action's ``mb`` is a (micro-batch, slice) unit ``u = mb * segments + slice``, ``m``
    counts units, and F of slice j needs F of slice j-1 of the same stage, the backward
    of slice j-1 the backward of slice j (``segment_dependencies``).
    """

    name: str
    p: int
    m: int
    v: int
    num_stages: int
    placement: dict[tuple[int, int], int]
    mb_pipe: list[int]
    actions: list[list[Action]]
    split_backward: bool
    asynchronous: bool = False
    overlapped: list[tuple[Action, Action]] = field(default_factory=list)
    done_before: frozenset = field(default_factory=frozenset)
    notes: str = field(default="", compare=False)
    segments: int = 1

    # -- placement -------------------------------------------------------
    def rank_of(self, action: Action) -> int:
        """The rank that must run `action` (from `placement`)."""
        try:
            return self.placement[(action.pipe, action.stage)]
        except KeyError:
            raise ScheduleError(
                f"{self.name}: no placement for pipe={action.pipe} stage={action.stage}"
            ) from None

    @property
    def pipes(self) -> list[int]:
        return sorted({pipe for pipe, _ in self.placement})

    def stages_of(self, rank: int) -> list[tuple[int, int]]:
        """The ``(pipe, stage)`` pairs held by `rank`, in chunk order."""
        return sorted(key for key, r in self.placement.items() if r == rank)

    def chunk_of(self, pipe: int, stage: int) -> int:
        """Index of ``(pipe, stage)`` among the stages its rank holds (0-based)."""
        rank = self.placement[(pipe, stage)]
        return self.stages_of(rank).index((pipe, stage))

    def label(self, action: Action) -> str:
        """Paper-style label: 'F3' when every rank holds one stage per replica, 'F3c1' otherwise.

        Micro-batches are numbered globally, so bidirectional schedules need no
        pipe suffix: the micro-batch number already says which replica it uses.
        """
        text = f"{action.kind}{action.mb}"
        if self.segments > 1:  # unit u = (micro-batch, slice): 'F3.1'
            text = f"{action.kind}{action.mb // self.segments}.{action.mb % self.segments}"
        if self.v > 1:
            text += f"c{self.chunk_of(action.pipe, action.stage)}"
        return text

    # -- derived views ---------------------------------------------------
    def iter_actions(self) -> Iterator[tuple[int, int, Action]]:
        """Yield ``(rank, position, action)`` for every action."""
        for rank, row in enumerate(self.actions):
            for pos, action in enumerate(row):
                yield rank, pos, action

    def num_actions(self) -> int:
        return sum(len(row) for row in self.actions)

    def text(self) -> list[str]:
        """Every rank's actions as one line of text (``parse_row`` reads a line back)."""
        return [row_text(row) for row in self.actions]

    def with_text(self, lines: Iterable[str]) -> "Schedule":
        """A copy of this schedule (same p, m, placement, ...) whose rank r runs the actions
        of ``lines[r]`` -- a test or a suite states a variant of a schedule as text."""
        from dataclasses import replace
        rows = [parse_row(line) for line in lines]
        if len(rows) != self.p:
            raise ScheduleError(f"{self.name}: {len(rows)} lines of actions, expected p={self.p}")
        return replace(self, actions=rows, overlapped=[], done_before=frozenset())

    def backward_kinds(self) -> dict[tuple[int, int, int], str]:
        """``(mb, stage, pipe) -> 'B' | 'BW'``: which action carries the input gradient."""
        found: dict[tuple[int, int, int], str] = {}
        for _, _, a in self.iter_actions():
            if a.kind in INPUT_GRAD_KINDS:
                found.setdefault((a.mb, a.stage, a.pipe), a.kind)
        return found

    def dependencies(self, action: Action, backward_kinds=None) -> list[Action]:
        """The actions `action` depends on (see module docstring for the rules).

        `backward_kinds` (from :meth:`backward_kinds`) says whether the backward of
        the next stage is a ``B`` or a ``BW``; pass it when calling in a loop.
        """
        if backward_kinds is None:
            backward_kinds = self.backward_kinds()
        deps = self._stage_dependencies(action, backward_kinds)
        if self.segments > 1:
            deps += self.segment_dependencies(action, backward_kinds)
        return deps

    def segment_dependencies(self, action: Action, backward_kinds) -> list[Action]:
        """Within one stage: F of slice j needs F of slice j-1 (its cached K/V), the
        backward-for-inputs of slice j needs that of slice j+1 (the K/V gradients)."""
        a, k = action, self.segments
        if a.kind == FORWARD and a.mb % k:
            return [Action(FORWARD, a.mb - 1, a.stage, a.pipe)]
        if a.kind in INPUT_GRAD_KINDS and a.mb % k < k - 1:
            kind = backward_kinds.get((a.mb + 1, a.stage, a.pipe), BACKWARD_FULL)
            return [Action(kind, a.mb + 1, a.stage, a.pipe)]
        return []

    def _stage_dependencies(self, action: Action, backward_kinds) -> list[Action]:
        a = action
        if a.kind == FORWARD:
            return [Action(FORWARD, a.mb, a.stage - 1, a.pipe)] if a.stage > 0 else []
        if a.kind == BACKWARD_WEIGHT:
            return [Action(BACKWARD_INPUT, a.mb, a.stage, a.pipe)]
        deps = [Action(FORWARD, a.mb, a.stage, a.pipe)]
        if a.stage < self.num_stages - 1:
            kind = backward_kinds.get((a.mb, a.stage + 1, a.pipe), BACKWARD_FULL)
            deps.append(Action(kind, a.mb, a.stage + 1, a.pipe))
        return deps

    def comm(self) -> list[P2PTransfer]:
        """Cross-rank transfers implied by the dependencies, in the receivers' order."""
        kinds = self.backward_kinds()
        out: list[P2PTransfer] = []
        for rank, _, a in self.iter_actions():
            for dep in self.dependencies(a, kinds):
                src = self.rank_of(dep)
                if src == rank:
                    continue
                kind = "act" if a.kind == FORWARD else "grad"
                out.append(P2PTransfer(kind=kind, mb=a.mb, src_stage=dep.stage,
                                       dst_stage=a.stage, pipe=a.pipe, src_rank=src,
                                       dst_rank=rank))
        return out

    def work(self) -> dict[str, int]:
        """Count of actions by kind (for reports)."""
        counts = {k: 0 for k in KINDS}
        for _, _, a in self.iter_actions():
            counts[a.kind] = counts.get(a.kind, 0) + 1
        return counts


# -- placements --------------------------------------------------------------
def linear_placement(p: int) -> dict[tuple[int, int], int]:
    """Stage s on rank s (one stage per rank)."""
    return {(0, s): s for s in range(p)}


def looped_placement(p: int, v: int) -> dict[tuple[int, int], int]:
    """Stage s on rank ``s % p`` (Megatron interleaved / looped BFS)."""
    return {(0, s): s % p for s in range(p * v)}


def v_placement(p: int) -> dict[tuple[int, int], int]:
    """V shape over 2p stages: rank r holds stages r and 2p-1-r (ZB-V, DualPipeV)."""
    placement = {}
    for s in range(2 * p):
        placement[(0, s)] = s if s < p else 2 * p - 1 - s
    return placement


def wave_placement(p: int, v: int) -> dict[tuple[int, int], int]:
    """Zig-zag over p*v stages (Hanayo, Liu et al. 2023): chunk c = s // p runs down the
    ranks when c is even and back up when odd, so rank r holds stages c*p + r (c even) and
    c*p + p-1-r (c odd); v=2 is the V placement, each turn is a local hand-off."""
    placement = {}
    for s in range(p * v):
        c, q = divmod(s, p)
        placement[(0, s)] = q if c % 2 == 0 else p - 1 - q
    return placement


def bidirectional_placement(p: int) -> dict[tuple[int, int], int]:
    """Two replicas of p stages: pipe 0 stage s on rank s, pipe 1 stage s on rank p-1-s."""
    placement = {(0, s): s for s in range(p)}
    placement.update({(1, s): p - 1 - s for s in range(p)})
    return placement


def split_fused(row: list[Action]) -> list[Action]:
    """Replace every fused ``BW`` by ``B`` immediately followed by ``W``."""
    out: list[Action] = []
    for a in row:
        if a.kind == BACKWARD_FULL:
            out.append(Action(BACKWARD_INPUT, a.mb, a.stage, a.pipe))
            out.append(Action(BACKWARD_WEIGHT, a.mb, a.stage, a.pipe))
        else:
            out.append(a)
    return out
