"""Lowering: the point-to-point transfers of a schedule written into its per-rank lists.

A generated schedule lists compute actions only. ``lower(schedule)`` inserts, on every rank,
the ``SF`` / ``SB`` sends and ``RF`` / ``RB`` receives its cross-rank dependencies imply
(``actions.ActionKind``), so an executor walks one list and dispatches each entry -- the idea
of torch.distributed.pipelining's action lists with communication added, written afresh for
parbench's schedules. The rules (one place; ``p2p_problems`` checks them without ranks, in ``lower_check``):

* a send follows the compute action that produces its tensor, at once;
* the receives a compute action needs come before it, and a receiver posts its receives
  from one sender in the order that sender sends: NCCL and gloo match the messages of a pair
  of ranks by order, not by tag, so when a rank needs a later message first it posts the
  earlier ones from the same sender too;
* ``lookahead=k`` also posts the receives of the next k compute actions (gloo moves a
  message only once its receive is posted, so on CPU an early receive overlaps the
  transfer with compute; on NCCL an early receive would sit in front of later sends on
  the communicator's stream, so there ``k=0``); never across a step cut (``cuts``);
* consecutive p2p entries form one batch (``batch_isend_irecv``): a compute's output send
  and the next compute's receives go out together (Megatron's ``send_forward_recv_backward``
  pattern, which keeps two neighbours that exchange at once from deadlocking on NCCL);
* a hand-off between two stages on one rank is local: no entry.

Which message a p2p entry moves (``transfer_key``): ``SF(mb, s)`` / ``RF(mb, s+1)`` the
activation F(mb, s) produced, ``SB(mb, s)`` / ``RB(mb, s-1)`` the input gradient of the
backward of (mb, s); key ``("act" | "grad", mb, producing stage, pipe)``.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .actions import (
    FORWARD,
    INPUT_GRAD_KINDS,
    P2P_KINDS,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    Schedule,
    ScheduleError,
)


@dataclass
class Lowered:
    """A schedule with its p2p entries: ``actions[r]`` (compute and p2p, in order) and
    ``starts[r][k]``, the position where the entries posted for compute action k begin (its
    receives; ``starts[r][n]`` is the row's end), so compute slice ``[lo, hi)`` of a step
    is ``actions[r][starts[r][lo]:starts[r][hi]]``, the sends of action hi-1 included."""

    schedule: Schedule
    actions: list[list[Action]]
    starts: list[list[int]]
    lookahead: int

    def peer(self, action: Action) -> int:
        """The rank a p2p entry sends to or receives from."""
        return peer_of(self.schedule, action)

    def text(self) -> list[str]:
        """Every rank's lowered list as one line of text (``actions.parse_row`` reads it)."""
        return [" ".join(map(str, row)) for row in self.actions]


def transfer_key(action: Action) -> tuple:
    """The message a p2p entry moves: ``(kind, mb, producing stage, pipe)``."""
    k, mb, stage, pipe = action.kind, action.mb, action.stage, action.pipe
    if k == SEND_F or k == SEND_B:
        return ("act" if k == SEND_F else "grad", mb, stage, pipe)
    if k == RECV_F:
        return ("act", mb, stage - 1, pipe)
    if k == RECV_B:
        return ("grad", mb, stage + 1, pipe)
    raise ScheduleError(f"action={action}: kind {k!r} is not a p2p kind (SF, RF, SB, RB)")


def peer_of(schedule: Schedule, action: Action) -> int:
    """The rank a p2p entry sends to or receives from."""
    step = 1 if action.kind in (SEND_F, RECV_B) else -1
    return schedule.placement[(action.pipe, action.stage + step)]


def produced(schedule: Schedule, a: Action) -> tuple[Action, int] | None:
    """The send a compute action's output needs, with the destination rank (None: the
    action sends nothing -- a last-stage F, a first-stage backward, a W)."""
    if a.kind == FORWARD and a.stage < schedule.num_stages - 1:
        return Action(SEND_F, a.mb, a.stage, a.pipe), schedule.placement[(a.pipe, a.stage + 1)]
    if a.kind in INPUT_GRAD_KINDS and a.stage > 0:
        return Action(SEND_B, a.mb, a.stage, a.pipe), schedule.placement[(a.pipe, a.stage - 1)]
    return None


def needed(schedule: Schedule, a: Action) -> tuple[Action, int] | None:
    """The receive a compute action's input needs, with the source rank (None: its input is
    the tokens, the loss, or its own B)."""
    if a.kind == FORWARD and a.stage > 0:
        return Action(RECV_F, a.mb, a.stage, a.pipe), schedule.placement[(a.pipe, a.stage - 1)]
    if a.kind in INPUT_GRAD_KINDS and a.stage < schedule.num_stages - 1:
        return Action(RECV_B, a.mb, a.stage, a.pipe), schedule.placement[(a.pipe, a.stage + 1)]
    return None


def _matching_recv(send: Action) -> Action:
    if send.kind == SEND_F:
        return Action(RECV_F, send.mb, send.stage + 1, send.pipe)
    return Action(RECV_B, send.mb, send.stage - 1, send.pipe)


def _recv_queues(schedule: Schedule, rank: int) -> dict[int, list[Action]]:
    """Per source rank, the receives of ``rank`` in the order that source sends them."""
    queues: dict[int, list[Action]] = {}
    for src, row in enumerate(schedule.actions):
        if src == rank:
            continue
        for a in row:
            out = produced(schedule, a)
            if out is not None and out[1] == rank:
                queues.setdefault(src, []).append(_matching_recv(out[0]))
    return queues


def lower_rank(schedule: Schedule, rank: int, lookahead: int = 0,
               cuts=()) -> tuple[list[Action], list[int]]:
    """Rank ``rank``'s lowered list and its ``starts`` (see :class:`Lowered`, :func:`lower`)."""
    row = schedule.actions[rank]
    queues = _recv_queues(schedule, rank)
    nxt = dict.fromkeys(range(schedule.p), 0)
    posted: set[Action] = set()

    def receives(a: Action) -> list[Action]:
        """The receive ``a`` needs and every earlier one from the same sender."""
        need = needed(schedule, a)
        if need is None or need[1] == rank or need[0] in posted:
            return []
        recv, src = need
        out, queue = [], queues.get(src, [])
        while nxt[src] < len(queue):
            r = queue[nxt[src]]
            nxt[src] += 1
            posted.add(r)
            out.append(r)
            if r == recv:
                return out
        raise ScheduleError(f"{schedule.name}: rank {rank} needs {recv} from rank {src}, "
                            "which never sends it")

    lowered, starts = [], []
    ends = sorted({c for c in cuts if 0 < c < len(row)}) + [len(row)]
    e = 0
    for k, a in enumerate(row):
        while ends[e] <= k:
            e += 1
        end = ends[e]  # the step of k ends there: no receive is posted ahead past it
        starts.append(len(lowered))
        lowered += receives(a)
        for later in row[k + 1:min(k + 1 + lookahead, end)]:
            lowered += receives(later)
        lowered.append(a)
        out = produced(schedule, a)
        if out is not None and out[1] != rank:
            lowered.append(out[0])
    starts.append(len(lowered))
    return lowered, starts


def lower(schedule: Schedule, *, lookahead: int = 0,
          cuts: list[list[int]] | None = None) -> Lowered:
    """``schedule`` with its sends and receives inserted (module docstring for the rules).

    ``cuts[r]``: positions of rank r's compute row where a step starts (a continuous run
    cut into steps, ``continuous.step_bounds``); receives are never posted ahead across one.
    """
    if lookahead < 0:
        raise ScheduleError(f"lookahead={lookahead} must be >= 0")
    rows, starts = [], []
    for r in range(schedule.p):
        row, at = lower_rank(schedule, r, lookahead, cuts[r] if cuts else ())
        rows.append(row)
        starts.append(at)
    return Lowered(schedule, rows, starts, lookahead)


def batches(row: list[Action]) -> list[list[Action] | Action]:
    """A lowered row as compute actions and batches (runs of consecutive p2p entries)."""
    out: list = []
    run: deque = deque()
    for a in row:
        if a.kind in P2P_KINDS:
            run.append(a)
            continue
        if run:
            out.append(list(run))
            run.clear()
        out.append(a)
    if run:
        out.append(list(run))
    return out
