"""DistFlashAttn's load-balanced causal schedule as data (Li et al. 2023, "DISTFLASHATTN:
Distributed Memory-efficient Attention for Long-context LLMs Training", arXiv 2310.03294,
Sec. 3.1 and its figure of the balanced schedule).

P workers hold contiguous sequence chunks (worker r: tokens [r n, (r+1) n)). Under a causal
mask worker r needs the K/V of chunks 0..r: r + 1 blocks, so with the plain schedule the last
worker computes P blocks while worker 0 computes one and then idles. The balanced schedule
runs a diagonal step 0 and then ``steps(P) = P // 2`` further time steps; at step t:

- worker r >= t computes its own queries against chunk r - t (K/V sent by worker r - t);
- worker r < t, for t <= ``helping_steps(P)``, is a *helper*: it receives the queries of the
  busy worker r + P - t, computes them against its own K/V and sends the partial output and
  its log-sum-exp back to that worker, who folds it in with the online-softmax rule;
- otherwise (the last step, P even, workers r < P/2) the worker idles.

A busy worker r > P // 2 computes chunks r-1 .. r - P//2 itself and gets chunks
0 .. r - P//2 - 1 from helpers, so every causal block is computed exactly once. Helping needs
t <= P - 1 - P // 2: ``P // 2`` steps when P is odd (no worker ever idles), one fewer when
P is even (P/2 workers idle in the last step). Every worker then computes the diagonal block
and ``P // 2`` (odd P) or ``P/2 - 1`` / ``P/2`` (even P, first / second half) full blocks,
against ``r`` for the unbalanced causal ring.

Nothing here touches a tensor: ``StepTask`` says what one worker does at one step, and the
executor (``distflash_attn``) posts the messages the tasks imply.
"""
from __future__ import annotations

from dataclasses import dataclass


def steps(P: int) -> int:
    """Time steps after the diagonal step 0."""
    return P // 2


def helping_steps(P: int) -> int:
    """Steps at which idle workers help: t <= P - 1 - P // 2."""
    return P - 1 - P // 2


@dataclass(frozen=True)
class StepTask:
    """Worker ``rank``'s part of step ``t`` (1 <= t <= steps(P)).

    ``local``: the K/V chunk it attends its own queries to (None: none); ``helps``: the worker
    whose queries it computes against its own K/V (None: none); ``send_kv`` / ``send_q``: the
    worker its K/V / queries go to for this step; ``helped_by``: the helper computing a chunk
    of its queries at this step (whose partial result it merges)."""

    t: int
    local: int | None
    helps: int | None
    send_kv: int | None
    send_q: int | None
    helped_by: int | None


class BalancedSchedule:
    """The schedule of ``P`` workers; subclasses (mutants) may change ``helping_steps``."""

    def __init__(self, P: int):
        self.P = P

    def steps(self) -> int:
        return steps(self.P)

    def helping_steps(self) -> int:
        return helping_steps(self.P)

    def task(self, rank: int, t: int) -> StepTask:
        P, H = self.P, self.helping_steps()
        local = rank - t if t <= rank else None
        helps = rank + P - t if local is None and t <= H else None
        send_kv = rank + t if rank + t < P else None
        send_q = rank + t - P if send_kv is None and t <= H else None
        return StepTask(t, local, helps, send_kv, send_q, send_q)

    def tasks(self, rank: int) -> list[StepTask]:
        return [self.task(rank, t) for t in range(1, self.steps() + 1)]

    def blocks(self, rank: int) -> int:
        """Kernel calls of ``rank`` in one forward: the diagonal plus its full blocks."""
        return 1 + sum((x.local is not None) + (x.helps is not None) for x in self.tasks(rank))
