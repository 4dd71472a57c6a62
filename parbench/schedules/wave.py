"""Wave-like and memory-controlled V schedules: Hanayo, V-Half, V-Min.

* Hanayo — Liu, Cheng, Zhou & You 2023, "Hanayo: Harnessing Wave-like Pipeline Parallelism
  for Enhanced Large Model Training Efficiency" (SC'23, arXiv:2308.15762), Sec. 3: the model
  is cut into p·v stages placed in waves, down the ranks and back up (``wave_placement``:
  chunk c of rank r is stage c·p + r for even c and c·p + p-1-r for odd c), so each rank
  holds v chunks, the W = v/2 waves of the paper, one model replica only (unlike Chimera),
  and every turn of the wave is a local hand-off. The paper draws forward and (fused)
  backward slots of equal length; with W waves it states the bubble ratio
  (P-1)/(2W·N + P-1), i.e. (p-1)/(v·m + p-1) (its bubble-ratio comparison with GPipe, DAPPLE
  and Chimera, Sec. 3). The per-rank order here is built by list scheduling on those equal
  slots (forward = fused backward = 1): an idle rank runs the ready action of the oldest
  micro-batch, furthest along its path (so backwards before forwards of the same
  micro-batch), and starts a new forward only while fewer than v·p chunk activations are in
  flight on it (1F1B's p micro-batches of a whole rank's layers). That reproduces the
  closed form exactly whenever p divides m (as Megatron's interleaved schedule requires)
  and the waves are whole (v even); other m, or an odd v, run with a larger bubble.
* V-Half and V-Min — Qi, Wan, Huang & Lin 2024, "Pipeline Parallelism with Controllable
  Memory" (NeurIPS 2024, arXiv:2405.15362), Sec. 3-4: a schedule is one *building block*
  (the F, B, W passes of one micro-batch on every rank) repeated every T = 6 slots
  (T_F = T_B = T_W = 1 per chunk, two chunks per rank in the V placement of ZB-V); the peak
  activation memory of a rank is the lifespan l of its chunks' activations divided by T,
  rounded up (Sec. 3.1). The V-Min and V-Half blocks (Sec. 4.1, Fig. 4) start, on rank r,
  F of chunk 0 at r (V-Min) or 2r (V-Half), F of chunk 1 at 2p-1-r (3p-2-r), B of chunk 1
  at 2p+g+r (3p+g+2r-1) and B of chunk 0 at 4p+g-1-r (6p+g-2-r), with the offset g = 2
  when 3 | p (V-Min) and g = 3 when 2 | p (V-Half) so that no two passes of a rank collide
  modulo T; every W runs in the first free slot after its B (oldest first). Listing each
  rank's passes in slot order and running them as early as dependencies allow is the
  paper's "squeeze". The lifespans give about 2p/3 + 2 (V-Min) and p + 2 (V-Half) chunk
  activations, i.e. about 1/3 and 1/2 of 1F1B's 2p (p·M_B with M_B = two chunks).
  The paper's further reordering of the warm-up and cool-down is not done: the bubble here
  is that of the squeezed blocks (``v_block_bubble``).
"""
from __future__ import annotations

import heapq
from math import ceil

from .actions import (
    BACKWARD_FULL,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    Action,
    ScheduleError,
    wave_placement,
)
from .closed_forms import ClosedForm, v_shape_memory
from .spec import ChunkRule, Costs, Placement, Rows, schedule_spec

#: the repetition interval of the V-Min / V-Half building blocks, in unit slots
V_PERIOD = 6


# ---- Hanayo -----------------------------------------------------------------------------

def hanayo_closed_form(p: int, m: int, v: int, tf: float, tb: float, tw: float,
                       overlap: bool) -> ClosedForm:
    """Liu et al. 2023 (Hanayo) Sec. 3: bubble ratio (P-1)/(2W·N + P-1) with W = v/2 waves,
    in equal forward and backward slots (T_F = T_B + T_W): idle (p-1)·(T_F + T_B + T_W)
    per rank against v·m·(T_F + T_B + T_W) of work. Exact for the generator when p | m and
    v is even."""
    equal_slots = tf == tb + tw
    return ClosedForm.of(
        m=m, v=v, tf=tf, tb=tb, tw=tw,
        bubble_size=(p - 1) * (tf + tb + tw) if equal_slots else None,
        formula="(P-1)/(2W*N+P-1), W = v/2 waves",
        source="Liu et al. 2023 (Hanayo), Sec. 3",
        exact=equal_slots and m % p == 0 and v % 2 == 0,
        conditions="T_F = T_B + T_W (equal slots), m % p == 0, whole waves (v even)")


def _progress(a: Action, num_stages: int) -> int:
    """How far along its path (S forwards, then S backwards) a micro-batch's action is."""
    return a.stage if a.kind == FORWARD else 2 * num_stages - 1 - a.stage


def hanayo_order(p: int, m: int, v: int, placement: dict, cap: int) -> list[list[Action]]:
    """Per-rank orders by list scheduling on equal slots (see the module docstring)."""
    S = p * v  # noqa: N806
    rows: list[list[Action]] = [[] for _ in range(p)]
    free, inflight = [0] * p, [0] * p
    ready: list[set] = [set() for _ in range(p)]
    ready[placement[(0, 0)]].update(Action(FORWARD, i, 0) for i in range(m))
    running: list[tuple[int, int, Action]] = []
    now, started, total = 0, 0, 2 * m * S
    while started < total:
        for r in range(p):
            if free[r] > now:
                continue
            fits = [a for a in ready[r] if a.kind != FORWARD or inflight[r] < cap]
            if not fits:
                continue
            a = min(fits, key=lambda x: (x.mb, -_progress(x, S)))
            ready[r].discard(a)
            inflight[r] += 1 if a.kind == FORWARD else -1
            rows[r].append(a)
            free[r] = now + 1
            heapq.heappush(running, (now + 1, started, a))
            started += 1
        if not running:
            raise ScheduleError(f"hanayo (p={p}, m={m}, v={v}): list scheduling stalled")
        now = running[0][0]
        while running and running[0][0] <= now:
            _, _, a = heapq.heappop(running)
            if a.kind == FORWARD and a.stage < S - 1:
                nxt = Action(FORWARD, a.mb, a.stage + 1)
            elif a.kind == FORWARD:
                nxt = Action(BACKWARD_FULL, a.mb, a.stage)
            elif a.stage > 0:
                nxt = Action(BACKWARD_FULL, a.mb, a.stage - 1)
            else:
                continue
            ready[placement[(0, nxt.stage)]].add(nxt)
    return rows


@schedule_spec(
    "hanayo", description="Hanayo (Liu et al. 2023): wave placement, v/2 waves, one replica",
    chunks=ChunkRule.ANY, placement=Placement.WAVE, closed_form=hanayo_closed_form,
    paper_costs=Costs(tf=1.0, tb=1.0, tw=0.0), memory=v_shape_memory,
    memory_note="at most v p chunk activations, p micro-batches of a rank's layers as 1F1B, "
                "one model replica (Liu et al. 2023, Sec. 3)")
def hanayo(p: int, m: int, v: int) -> Rows:
    """Hanayo with v chunks per rank (v/2 waves; v=2 is one V; an odd v ends half way
    through its last wave, on rank p-1), fused backwards."""
    rows = hanayo_order(p, m, v, wave_placement(p, v), cap=v * p)
    return Rows(rows, notes=f"{v / 2:g} wave(s)")


# ---- V-Half and V-Min (building blocks) ------------------------------------------------------

def v_block(kind: str, p: int, rank: int) -> dict[str, int]:
    """Slots of one micro-batch's F and B passes on ``rank`` in the building block of
    ``kind`` ('vmin' or 'vhalf'), Qi et al. 2024b Sec. 4.1 / Fig. 4 (see module docstring).
    Keys: F0, F1 (forwards of chunk 0 = stage r, chunk 1 = stage 2p-1-r), B1, B0."""
    r = rank
    if kind == "vmin":
        g = 2 if p % 3 == 0 else 0
        return {"F0": r, "F1": 2 * p - 1 - r, "B1": 2 * p + g + r, "B0": 4 * p + g - 1 - r}
    if kind == "vhalf":
        g = 3 if p % 2 == 0 else 0
        return {"F0": 2 * r, "F1": 3 * p - 2 - r, "B1": 3 * p + g + 2 * r - 1,
                "B0": 6 * p + g - 2 - r}
    raise ScheduleError(f"kind={kind!r} must be 'vmin' or 'vhalf'")


def v_block_inflight(kind: str, p: int, m: int, rank: int) -> int:
    """Peak chunk activations in flight (F to B) on ``rank`` by the building block: per chunk
    ceil(l / T), l = B slot + 1 - F slot (Qi et al. 2024b Sec. 3.1), at most m; summed over
    the two chunks (an upper bound: the two peaks need not coincide)."""
    b = v_block(kind, p, rank)
    return sum(min(m, ceil((b[f"B{c}"] + 1 - b[f"F{c}"]) / V_PERIOD)) for c in (0, 1))


def v_block_bubble(kind: str, p: int) -> float:
    """Idle time per rank of the squeezed building blocks at T_F = T_B = T_W = 1 per chunk
    (from a common start; V-Min for p, m >= 2, V-Half for m > p/2): V-Min 4p - 5 + g (g = 2 when 3 | p), V-Half
    (7p - 7)/2 + 3/2 when p is even, (7p - 7)/2 when odd. Derived here from the blocks of
    Qi et al. 2024b Sec. 4.1, not stated in the paper (1F1B idles 6(p-1) in these units)."""
    if kind == "vmin":
        return 4 * p - 5 + (2 if p % 3 == 0 else 0)
    return 3.5 * (p - 1) + (1.5 if p % 2 == 0 else 0.0)


def _v_closed_form(kind: str):
    def closed_form(p: int, m: int, v: int, tf: float, tb: float, tw: float,
                    overlap: bool) -> ClosedForm:
        equal = tf == tb == tw
        return ClosedForm.of(
            m=m, v=v, tf=tf, tb=tb, tw=tw,
            bubble_size=v_block_bubble(kind, p) * tf if equal else None,
            formula=("4p-5+2[3|p]" if kind == "vmin" else "3.5(p-1)+1.5[2|p]")
            + " chunk slots (squeezed building block)",
            source="building block of Qi et al. 2024b Sec. 4.1 (bubble derived in parbench)",
            exact=equal and (m >= p // 2 + 1 if kind == "vhalf" else p >= 2 and m >= 2),
            conditions="T_F = T_B = T_W, " + ("m > p/2" if kind == "vhalf" else "p, m >= 2"))
    return closed_form


def v_block_order(kind: str, p: int, m: int, rank: int) -> list[Action]:
    """The passes of ``rank`` in slot order: block slots + 6·mb, W's in free slots."""
    stage = {"0": rank, "1": 2 * p - 1 - rank}
    slots: dict[int, Action] = {}
    for key, t in v_block(kind, p, rank).items():
        kind_ = FORWARD if key[0] == "F" else BACKWARD_INPUT
        for mb in range(m):
            slots[t + V_PERIOD * mb] = Action(kind_, mb, stage[key[1]])
    row: list[Action] = []
    pending: list[Action] = []
    t, end = 0, max(slots) + 1
    while t < end or pending:
        a = slots.get(t)
        if a is not None:
            row.append(a)
            if a.kind == BACKWARD_INPUT:
                pending.append(Action(BACKWARD_WEIGHT, a.mb, a.stage))
        elif pending:
            row.append(pending.pop(0))
        t += 1
    return row


def v_block_memory(kind: str):
    """``memory(p, m, v, rank)`` of a building block: its chunk activations in flight
    (``v_block_inflight``), each half a rank's layers (Qi et al. 2024b, Sec. 3.1)."""
    def memory(p: int, m: int, v: int, rank: int) -> float:
        return v_block_inflight(kind, p, m, rank) / 2
    return memory


@schedule_spec(
    "vhalf", description="V-Half (Qi et al. 2024b): V placement, ~1/2 of 1F1B's activations",
    chunks=ChunkRule.TWO, placement=Placement.V, splits_backward=True,
    closed_form=_v_closed_form("vhalf"), memory=v_block_memory("vhalf"),
    max_inflight=lambda p, m, rank: v_block_inflight("vhalf", p, m, rank),
    memory_note="about half of 1F1B's activations: p + 2 chunk activations of half a "
                "rank's layers on the first rank (Qi et al. 2024b, Sec. 4.1)")
def vhalf(p: int, m: int, v: int) -> list[list[Action]]:
    """V-Half: the building block with F of chunk 0 every 2 slots down the ranks."""
    return [v_block_order("vhalf", p, m, r) for r in range(p)]


@schedule_spec(
    "vmin", description="V-Min (Qi et al. 2024b): V placement, ~1/3 of 1F1B's activations",
    chunks=ChunkRule.TWO, placement=Placement.V, splits_backward=True,
    closed_form=_v_closed_form("vmin"), memory=v_block_memory("vmin"),
    max_inflight=lambda p, m, rank: v_block_inflight("vmin", p, m, rank),
    memory_note="about a third of 1F1B's activations: 2p/3 + 2 chunk activations of half a "
                "rank's layers on the first rank (Qi et al. 2024b, Sec. 4.1)")
def vmin(p: int, m: int, v: int) -> list[list[Action]]:
    """V-Min: the tightest V building block (lifespan about 4p slots)."""
    return [v_block_order("vmin", p, m, r) for r in range(p)]
