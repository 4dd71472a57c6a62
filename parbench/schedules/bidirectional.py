"""Bidirectional and V-shaped schedules: Chimera, DualPipe, DualPipeV.

* Chimera — Li & Hoefler 2021, "Chimera: Efficiently Training Large-Scale Neural
  Networks with Bidirectional Pipelines" (SC'21), §3: two replicas of the D = p
  stage model, the *down* pipeline (pipe 0, stage s on rank s) and the *up*
  pipeline (pipe 1, stage s on rank p-1-s); micro-batches split half/half.  A
  basic unit holds D micro-batches (D/2 per direction); each direction is
  scheduled with 1F1B and the two are merged slot by slot (§3.2).  We run the
  merge as a greedy list schedule: an action's priority is its time slot in its
  own direction's 1F1B timeline (unit F and B), ties broken in favour of the
  deeper stage.  For N = k·D micro-batches the k units are concatenated (§3.5):
  unit u's actions get priority over unit u+1's, and the later unit's forwards
  fill the idle slots at the end of the earlier one.  Needs even p and m a
  multiple of p.  With T_F = T_B this gives the paper's D-2 idle slots per
  worker, bubble ratio (D-2)/(2N+D-2) (Table 2), and activations in flight
  between D/2+1 and D per worker.
* DualPipe — DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", §3.2.1 and Fig. 5:
  two replicas (pipe 0 stage s on rank s, pipe 1 stage s on rank p-1-s), half of
  the m micro-batches fed from each end.  Each rank runs one program over its
  "near" stage (depth min(r, p-1-r)) and its "far" stage, in eight phases:
  near-stage forwards; near/far forward pairs; far B-W-F triples (split
  backward); the steady state of overlapped forward-and-backward pairs; a far
  backward with an overlapped pair; backward pairs (the second half split into
  B and W); W then near B; the remaining W's.  An overlapped F&B pair is
  modelled as two adjacent actions, F then BW (this simulator has no
  compute/communication overlap).  Needs even p, even m and m >= 2p.
* DualPipeV — the "cut-in-half" V-shaped variant (DeepSeek's DualPipe repository;
  torch.distributed.pipelining's ScheduleDualPipeV): one replica of 2p stages,
  rank r holds stages r and 2p-1-r, the same eight phases with p ranks playing
  the role of a half-pipeline.  Needs m >= 2p.
"""
from __future__ import annotations

from ._arguments import need_even_p
from .actions import (
    BACKWARD_FULL,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    Action,
    Schedule,
    ScheduleError,
    bidirectional_placement,
    linear_placement,
)
from .basic import one_f_one_b_rows
from .closed_forms import ClosedForm, dualpipe_memory, dualpipe_table2, v_shape_memory
from .listsched import list_schedule
from .simulate import make_cost, run_times
from .spec import ChunkRule, Costs, MinMicrobatches, Placement, Rows, schedule_spec

_PAIRS_NOTE = "overlapped F&B pairs are adjacent F, BW (see `overlapped`)"


def _chimera_check(p: int, m: int, v: int) -> None:
    need_even_p("chimera", p)
    if m % p:
        raise ScheduleError(f"chimera needs m to be a multiple of p (got m={m}, p={p})")


def _dualpipe_check(p: int, m: int, v: int) -> None:
    need_even_p("dualpipe", p)
    if m % 2:
        raise ScheduleError(f"dualpipe needs an even m (got m={m})")


def chimera_closed_form(p: int, m: int, v: int, tf: float, tb: float, tw: float,
                        overlap: bool) -> ClosedForm:
    """Li & Hoefler 2021 Table 2: (D-2)/(2N+D-2), D-2 idle slots per worker.

    The paper counts time in equal forward and backward slots, i.e. T_F equals the fused
    backward T_B + T_W; the closed form claims exactness only there, and the pipeline table
    evaluates it at those costs (``paper_costs``: T_F = T_B = 1, T_W = 0).  The two
    dispatchers this replaced disagreed: one reported the ratio whatever the costs.
    """
    equal_slots = tf == tb + tw
    return ClosedForm.of(
        m=m, v=v, tf=tf, tb=tb, tw=tw, bubble_size=(p - 2) * tf if equal_slots else None,
        formula="(D-2)/(2N+D-2)", source="Li & Hoefler 2021, Table 2", exact=equal_slots,
        conditions="T_F = T_B + T_W (equal F and B slots)")


def dualpipe_closed_form(p: int, m: int, v: int, tf: float, tb: float, tw: float,
                         overlap: bool) -> ClosedForm:
    """DeepSeek-V3 report Table 2: (PP/2-1)(F&B+B-3W) with B = T_B+T_W, W = T_W, F&B = F+B.

    PP is the number of stages: p for DualPipe (v=1), 2p for DualPipeV (v=2).  The table
    assumes each F&B pair runs as one overlapped unit (``overlap=True`` in the simulator,
    ``paper_costs`` here); parbench's executor runs the pair back to back.
    """
    row = dualpipe_table2(p * v, tf, tb + tw, tw)["dualpipe"]
    return ClosedForm.of(
        m=m, v=v, tf=tf, tb=tb, tw=tw, bubble_size=row.bubble, formula="(PP/2-1)(F&B+B-3W)",
        source=row.source, exact=overlap and tf <= tb and tw <= tb,
        conditions="overlap=True (F&B pairs as units), T_F <= T_B, T_W <= T_B",
        note="parbench's executor runs each F&B pair back to back")


@schedule_spec(
    "chimera",
    description="Chimera (Li & Hoefler 2021): two bidirectional replicas, grads synced",
    chunks=ChunkRule.ONE, placement=Placement.BIDIRECTIONAL, min_m=MinMicrobatches(1, 0),
    check=_chimera_check,
    closed_form=chimera_closed_form, paper_costs=Costs(tf=1.0, tb=1.0, tw=0.0),
    memory=v_shape_memory,
    memory_note="between D/2 + 1 and D micro-batches of activations per worker, two weight "
                "replicas (Li & Hoefler 2021, Sec. 3 and Table 2)")
def chimera(p: int, m: int, v: int) -> Rows:
    """Chimera: down and up 1F1B pipelines merged slot by slot, units concatenated."""
    half, units = p // 2, m // p
    # Slot of every action of one direction's 1F1B over D/2 micro-batches, unit costs.
    one_dir = Schedule(name="1f1b", p=p, m=half, v=1, num_stages=p,
                       placement=linear_placement(p), mb_pipe=[0] * half,
                       actions=one_f_one_b_rows(p, half), split_backward=False)
    slot = run_times(one_dir, make_cost(1, 1, 0))
    tasks, key = [], {}
    for u in range(units):
        for a, (start, _) in slot.items():
            for pipe, first in ((0, 0), (1, m // 2)):
                act = Action(a.kind, first + u * half + a.mb, a.stage, pipe)
                tasks.append(act)
                key[act] = (u, start, -a.stage)
    template = Schedule(name="chimera", p=p, m=m, v=1, num_stages=p,
                        placement=bidirectional_placement(p),
                        mb_pipe=[0] * (m // 2) + [1] * (m // 2), actions=[],
                        split_backward=False)
    rows = list_schedule(template, tasks, key.__getitem__, lambda a: 1.0)
    return Rows(rows, notes=f"{units} basic unit(s) of {p} micro-batches")


class _Program:
    """Builds one rank's list for DualPipe / DualPipeV from its near and far stage."""

    def __init__(self, near: tuple[int, int], far: tuple[int, int], first_mb: dict[int, int]):
        self.row: list[Action] = []
        self.stage = {0: near, 1: far}  # phase -> (pipe, stage)
        self.first_mb = first_mb  # pipe -> first global micro-batch of that pipe
        self.count: dict[tuple[str, int], int] = {}
        self.w_queue: list[Action] = []
        self.pairs: list[tuple[Action, Action]] = []

    def _next(self, kind: str, phase: int) -> Action:
        pipe, stage = self.stage[phase]
        n = self.count.get((kind, phase), 0)
        self.count[(kind, phase)] = n + 1
        return Action(kind, self.first_mb[pipe] + n, stage, pipe)

    def forward(self, phase: int) -> None:
        self.row.append(self._next(FORWARD, phase))

    def backward(self, phase: int, split: bool = False) -> None:
        """Full backward, or B now with its W queued (zero-bubble style)."""
        a = self._next("back", phase)
        if split:
            self.row.append(Action(BACKWARD_INPUT, a.mb, a.stage, a.pipe))
            self.w_queue.append(Action(BACKWARD_WEIGHT, a.mb, a.stage, a.pipe))
        else:
            self.row.append(Action(BACKWARD_FULL, a.mb, a.stage, a.pipe))

    def weight(self) -> None:
        if self.w_queue:
            self.row.append(self.w_queue.pop(0))

    def overlapped(self, f_phase: int, b_phase: int) -> None:
        """An overlapped forward-and-backward pair, modelled as F then BW."""
        self.forward(f_phase)
        self.backward(b_phase)
        self.pairs.append((self.row[-2], self.row[-1]))


def _eight_phases(prog: _Program, half_ranks: int, depth: int, per_pipe: int) -> _Program:
    """The DualPipe phase recipe for a rank at `depth` in a half-pipeline of `half_ranks` ranks.

    `per_pipe` is the number of micro-batches that enter through the near stage's
    pipe (m/2 for DualPipe, m for DualPipeV).
    """
    tail = half_ranks - depth - 1
    for _ in range(2 * tail):                       # 1: near forwards
        prog.forward(0)
    for _ in range(depth + 1):                      # 2: near/far forward pairs
        prog.forward(0)
        prog.forward(1)
    for _ in range(tail):                           # 3: far B, W, F
        prog.backward(1, split=True)
        prog.weight()
        prog.forward(1)
    for _ in range(per_pipe - 2 * half_ranks + depth + 1):  # 4: steady overlapped pairs
        prog.overlapped(0, 1)
        prog.overlapped(1, 0)
    for _ in range(tail):                           # 5: far backward + overlapped pair
        prog.backward(1)
        prog.overlapped(1, 0)
    split = False                                   # 6: backward pairs, second half split
    for i in range(depth + 1):
        if i == (depth + 1) // 2 and depth % 2 == 1:
            split = True
        prog.backward(1, split)
        if i == (depth + 1) // 2 and depth % 2 == 0:
            split = True
        prog.backward(0, split)
    for _ in range(tail):                           # 7: W then near B (split)
        prog.weight()
        prog.backward(0, split=True)
    while prog.w_queue:                             # 8: remaining W's
        prog.weight()
    return prog


@schedule_spec(
    "dualpipe", description="DualPipe (DeepSeek-V3 report): two replicas fed from both ends",
    chunks=ChunkRule.ONE, placement=Placement.BIDIRECTIONAL, splits_backward=True,
    min_m=MinMicrobatches(2, 0), check=_dualpipe_check, closed_form=dualpipe_closed_form,
    paper_costs=Costs(overlap=True), memory=dualpipe_memory,
    memory_note="PP + 1 micro-batches of activations, two parameter copies (DeepSeek-V3 "
                "report, Table 2)")
def dualpipe(p: int, m: int, v: int) -> Rows:
    """DualPipe (DeepSeek-V3): two replicas fed from both ends, eight-phase program."""
    half = p // 2
    first_mb = {0: 0, 1: m // 2}
    rows, pairs = [], []
    for r in range(p):
        depth = min(r, p - 1 - r)
        if r < half:   # near = pipe 0 stage r, far = pipe 1 stage p-1-r
            prog = _Program((0, r), (1, p - 1 - r), first_mb)
        else:          # mirror image: near = pipe 1 stage p-1-r, far = pipe 0 stage r
            prog = _Program((1, p - 1 - r), (0, r), first_mb)
        _eight_phases(prog, half, depth, m // 2)
        rows.append(prog.row)
        pairs += prog.pairs
    return Rows(rows, overlapped=pairs, notes=_PAIRS_NOTE)


@schedule_spec(
    "dualpipev", description="DualPipeV: DualPipe cut in half, V placement",
    chunks=ChunkRule.TWO, placement=Placement.V, splits_backward=True,
    min_m=MinMicrobatches(2, 0), closed_form=dualpipe_closed_form,
    paper_costs=Costs(overlap=True), memory=dualpipe_memory,
    memory_note="PP + 1 micro-batches of activations, one parameter copy (DeepSeek's "
                "DualPipe repository)")
def dualpipev(p: int, m: int, v: int) -> Rows:
    """DualPipeV: DualPipe cut in half, one replica of 2p stages in a V."""
    rows, pairs = [], []
    for r in range(p):
        prog = _Program((0, r), (0, 2 * p - 1 - r), {0: 0})
        _eight_phases(prog, p, r, m)
        rows.append(prog.row)
        pairs += prog.pairs
    return Rows(rows, overlapped=pairs, notes=_PAIRS_NOTE)
