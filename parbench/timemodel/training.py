"""What the time model reads and returns: ``Training`` (a parallel layout, its options,
precision and optimizer) and ``StepTime`` (the predicted step and its breakdown)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ..layout import Layout
from ..options import Options


#: the planner's defaults where they differ from a local case's: one sequence per
#: micro-batch, Megatron-sized gradient buckets (MiB)
PLAN_DEFAULTS = {"micro_batch_size": 1, "bucket_mb": 25.0}


@dataclass(frozen=True)
class Training:
    """One way to train a model: the parallel :class:`~parbench.layout.Layout`, the families'
    :class:`~parbench.options.Options`, the precision and the optimizer -- what the time
    model prices and the planner ranks.

    ``dtype``: bf16 | fp32; ``optimizer``: adamw | sgd; ``accounting``: an
    ``analytic.memory`` name (None: by dtype); ``attention``: eager | flash, how the
    activations are counted (``analytic.activations``); ``ranks_per_node``: None for the
    profile's; ``grad_accumulation``: fused | unfused, how each micro-batch's weight
    gradient reaches the gradient buffer (``timemodel.grad_accumulation``).
    The options the time model reads: ``sp``, ``zero_stage``, ``recompute``,
    ``cp_algorithm`` and ``cp_ulysses``, ``bucket_mb`` (``inf``: one flat buffer) and
    ``overlap_grad_reduce`` (False: the reduction runs after the backward, as the
    context-parallel schemes do).
    """

    layout: Layout = field(default_factory=lambda: Layout(micro_batch_size=1))
    options: Options = field(default_factory=lambda: Options().with_values(bucket_mb=25.0))
    dtype: str = "bf16"
    optimizer: str = "adamw"
    accounting: str | None = None
    attention: str = "eager"
    ranks_per_node: int | None = None
    grad_accumulation: str = "fused"

    @classmethod
    def of(cls, **fields: Any) -> "Training":
        """From bare names, as a command line gives them: layout fields, option names and
        this record's own (``Training.of(tp=8, pp=4, sp=True, zero_stage=1)``); the rest
        take :data:`PLAN_DEFAULTS` and the defaults."""
        return cls().with_values(**fields)

    def with_values(self, **fields: Any) -> "Training":
        """A copy with bare-named fields changed (layout, options or this record's)."""
        lay_names = {f.name for f in dataclasses.fields(Layout)}
        own = {f.name for f in dataclasses.fields(self)} - {"layout", "options"}
        lay = {k: v for k, v in fields.items() if k in lay_names}
        mine = {k: v for k, v in fields.items() if k in own}
        opts = {k: v for k, v in fields.items() if k not in lay_names | own}
        return dataclasses.replace(self, layout=dataclasses.replace(self.layout, **lay),
                                   options=self.options.with_values(**opts), **mine)


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
