"""What the time model reads and returns: ``Layout`` (a parallel layout and its options) and
``StepTime`` (the predicted step and its breakdown)."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any


SCHEDULES_SPLIT_BW = ("zb-h1", "zb-h2", "zbv", "dualpipe", "dualpipev")


@lru_cache(maxsize=None)
def splits_backward(schedule: str) -> bool:
    """True when the schedule runs separate B and W passes (read off a small instance of
    it: the listed zero-bubble shapes, and any registered later, such as V-Half / V-Min)."""
    if schedule in SCHEDULES_SPLIT_BW:
        return True
    from ..schedules import make_schedule
    try:
        sched = make_schedule(schedule, 2, 4)
    except Exception:  # noqa: BLE001 -- unknown here; the simulator names the problem
        return False
    return any(a.kind == "W" for acts in sched.actions for a in acts)
CP_ALGORITHMS = ("ring", "ring-attention", "ring-self-attention", "ulysses", "allgather",
                 "usp")


@dataclass(frozen=True)
class Layout:
    """One parallel layout of a training step (the planner's unit).

    The first fields are the planner's API; the rest refine what the closed forms assume:
    ``cp_algorithm`` (ring | ulysses | allgather | ring-self-attention | usp),
    ``cp_ulysses`` (USP's Ulysses degree), ``bucket_mb`` (DDP / ZeRO bucket size, MiB;
    ``inf``: one flat buffer), ``overlap_grad_reduce`` (False: the gradient reduction runs
    after the backward, as the context-parallel schemes do), ``etp`` (expert tp, 0 = tp),
    ``accounting`` (``analytic.memory`` name; None: by dtype), ``optimizer`` (adamw | sgd),
    ``ranks_per_node`` (None: the profile's).
    """

    tp: int = 1
    cp: int = 1
    ep: int = 1
    dp: int = 1
    pp: int = 1
    vpp: int = 1
    sp: bool = False
    schedule: str = "1f1b"
    zero_stage: int = 0
    recompute: str = "none"
    micro_batch_size: int = 1
    num_microbatches: int = 1
    dtype: str = "bf16"
    cp_algorithm: str = "ring"
    cp_ulysses: int = 1
    bucket_mb: float = 25.0
    overlap_grad_reduce: bool = True
    etp: int = 0
    accounting: str | None = None
    optimizer: str = "adamw"
    ranks_per_node: int | None = None

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.num_microbatches * self.dp


@dataclass
class StepTime:
    """The predicted step. Seconds unless named otherwise; ``exposed_comm_s`` per mesh axis
    (tp, cp, ep, dp, pp); ``memory_per_rank_bytes`` the most loaded rank's;
    ``heaviest_axis`` the axis with the most exposed communication (None: none);
    ``breakdown``: every term, for ``--verbose`` and ``--json``."""

    step_s: float
    tokens_per_s: float
    mfu: float
    compute_s: float
    recompute_s: float
    bubble_s: float
    exposed_comm_s: dict[str, float]
    memory_per_rank_bytes: float
    device_memory_bytes: float
    fits: bool
    heaviest_axis: str | None
    notes: list[str]
    breakdown: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict:
        from dataclasses import asdict
        return asdict(self)
