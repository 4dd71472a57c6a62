"""Several stages per rank in a loop (stage s on rank ``s % p``): interleaved 1F1B, looped BFS.

* Interleaved 1F1B — Narayanan et al. 2021, "Efficient Large-Scale Language Model
  Training on GPU Clusters Using Megatron-LM" (PTD-P), §2.2.2: each rank holds v
  model chunks; depth-first order.  Micro-batches are processed in groups of g:
  the k-th forward slot of a rank runs chunk ``(k // g) % v`` on micro-batch
  ``(k // (g*v)) * g + k % g``, backward slots run the chunks in reverse.  Rank r
  warms up with ``(v-1)*g + 2*(p-1-r)`` forwards (capped at ``m*v``), then
  alternates F and BW, then drains.  Megatron uses ``g = p`` and needs
  ``m % p == 0``; like torch.distributed.pipelining's ScheduleInterleaved1F1B we
  relax this with ``rounds = max(1, m // p)`` and ``g = m // rounds``, which
  needs ``m % rounds == 0`` (e.g. p=4, m=10 → g=5; p=4, m=3 → g=3).
* Looped BFS — Lamy-Poirier 2023, "Breadth-First Pipeline Parallelism": each rank
  runs the forward of all m micro-batches for its first chunk, then its second
  chunk, ..., then the backwards chunk by chunk in reverse.  With v=1 it is GPipe.
"""
from __future__ import annotations

from .actions import BACKWARD_FULL, FORWARD, Action, ScheduleError
from .closed_forms import (
    ClosedForm,
    all_microbatches_memory,
    interleaved_memory,
    pipeline_flush_size,
    ptdp_bubble_fraction,
)
from .spec import ChunkRule, Placement, Rows, schedule_spec


def looped_closed_form(p: int, m: int, v: int, tf: float, tb: float, tw: float,
                       overlap: bool) -> ClosedForm:
    """PTD-P §2.2.2: idle (p-1)(T_F+T_B+T_W) with per-chunk costs, ratio (p-1)/(v·m+p-1);
    exact for m >= p (interleaved and looped BFS alike)."""
    return ClosedForm.of(
        m=m, v=v, tf=tf, tb=tb, tw=tw, bubble_size=pipeline_flush_size(p, tf, tb, tw),
        formula="(p-1)/(v*m+p-1)", source="Narayanan et al. 2021 §2.2.2", exact=m >= p,
        conditions="m >= p", ptdp_fraction=ptdp_bubble_fraction(p, m, v))


def interleaved_group(p: int, m: int) -> int:
    """Micro-batch group size g (Megatron: g = p when p divides m)."""
    rounds = max(1, m // p)
    if m % rounds:
        raise ScheduleError(
            f"interleaved needs m to be a multiple of rounds = max(1, m // p) = {rounds} "
            f"(got m={m}, p={p}); use m % p == 0 or m < p"
        )
    return m // rounds


@schedule_spec(
    "interleaved",
    description="interleaved 1F1B, v chunks per rank (Narayanan et al. 2021, PTD-P)",
    chunks=ChunkRule.ANY, placement=Placement.LOOPED, can_split=True,
    check=lambda p, m, v: interleaved_group(p, m), closed_form=looped_closed_form,
    memory=interleaved_memory,
    memory_note="activations of p micro-batches on the first rank, times 1 + (p-1)/(p v) "
                "(Korthikanti et al. 2022, Sec. 4.2.3)")
def interleaved(p: int, m: int, v: int) -> Rows:
    """Megatron interleaved 1F1B with v chunks per rank (stage s on rank s % p)."""
    g = interleaved_group(p, m)
    total = m * v

    def slot(k: int, backward: bool) -> tuple[int, int]:
        group, within = divmod(k, g * v)
        chunk = within // g
        if backward:
            chunk = v - 1 - chunk
        return group * g + within % g, chunk

    # the k-th forward and backward slots are the same (mb, chunk) on every rank
    forward_slots = [slot(k, False) for k in range(total)]
    backward_slots = [slot(k, True) for k in range(total)]
    rows = []
    for r in range(p):
        warm = min(total, (v - 1) * g + 2 * (p - 1 - r))
        fwd = [Action(FORWARD, mb, chunk * p + r) for mb, chunk in forward_slots]
        bwd = [Action(BACKWARD_FULL, mb, chunk * p + r) for mb, chunk in backward_slots]
        steady = [None] * (2 * (total - warm))  # F(warm + k), BW(k) for k < total - warm
        steady[0::2], steady[1::2] = fwd[warm:], bwd[:total - warm]
        rows.append(fwd[:warm] + steady + bwd[total - warm:])
    return Rows(rows, notes=f"micro-batch group g={g}")


@schedule_spec(
    "bfs", description="looped breadth-first (Lamy-Poirier 2023)",
    chunks=ChunkRule.ANY, min_chunks=1, placement=Placement.LOOPED, can_split=True,
    closed_form=looped_closed_form, memory=all_microbatches_memory,
    memory_note="activations of all m micro-batches for every chunk (Lamy-Poirier 2023)")
def looped_bfs(p: int, m: int, v: int) -> list[list[Action]]:
    """Looped breadth-first: all forwards chunk by chunk, then all backwards in reverse."""
    rows = []
    for r in range(p):
        stages = [c * p + r for c in range(v)]
        row = [Action(FORWARD, i, s) for s in stages for i in range(m)]
        row += [Action(BACKWARD_FULL, i, s) for s in reversed(stages) for i in range(m)]
        rows.append(row)
    return rows
