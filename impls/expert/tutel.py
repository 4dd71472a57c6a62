"""``expert.tutel``: Tutel's adaptive MoE layer (Hwang et al. 2023, "Tutel: Adaptive
Mixture-of-Experts at Scale", MLSys 2023, arXiv 2206.03382) on the expert-parallel layout of
``expert.alltoall`` (experts sharded over ep, replicated over edp = dp/ep, dense parameters
over dp).

Per MoE layer and micro-batch (``tutel_dispatch``):

- **adaptive capacity**: C = the ep group's largest need (one MAX all-reduce), capped by the
  Switch capacity when ``moe_capacity_factor > 0`` (Tutel's upper bound), unbounded at 0;
- **moe_mode** ``ep`` (all-to-alls of the ``[E, C, h]`` buffer), ``dp`` (experts all-gathered
  over the ep group in their EP layout, own tokens through all experts, gradients
  reduce-scattered back: Tutel's zero-cost switchable parallelism) or ``adaptive`` (the mode with
  fewer wire bytes, decided from the agreed C, so the whole ep group agrees);
- **moe_a2a** ``flat`` (one all-to-all over ep) or ``2d`` (Tutel's 2DH all-to-all,
  ``hier_a2a``: intra-node then inter-node on groups of their own, nodes of
  ``RANKS_PER_NODE`` = 2 consecutive ranks; ep must be a multiple of 2).

Gradients as in ``expert.alltoall``: after backward an expert's owner holds the sum over its ep
group of the ranks' gradients in either mode (the reverse all-to-all, or the reduce-scatter of
the gathered experts), so the dense all-reduce over dp and the expert all-reduce over edp,
both / dp, are unchanged. Golden-equivalent to the reference MoE with the same capacity factor
(cf = 0: nothing dropped). Closed forms: ``parbench.analytic.expert_tutel`` (C from the
single-device reference router's counts on the same data).
"""
from __future__ import annotations

from typing import ClassVar

from parbench.analytic.expert_tutel import tutel_prediction
from parbench.config import CaseConfig, ConfigError
from parbench.golden import reference_loads
from parbench.scheme import Prediction, register

from .hier_a2a import RANKS_PER_NODE, build_plan
from .scheme import MOE_OPTIONS, ExpertAllToAll
from .stats import StepStats, row_metrics
from .tutel_dispatch import TutelDispatch


class TutelStepStats(StepStats):
    """Adds each layer-micro-batch's capacity and mode (this rank, last checked step)."""

    def record(self, step, per_layer, ledger):
        super().record(step, per_layer, ledger)
        flat = [s for layer in per_layer for s in layer]
        if step in self.by_step:
            self.by_step[step]["capacities"] = [s["capacity"] for s in flat]
            self.by_step[step]["modes"] = [s["mode"] for s in flat]


@register
class ExpertTutel(ExpertAllToAll):
    name = "expert.tutel"
    options: ClassVar[tuple[str, ...]] = MOE_OPTIONS + ("moe_mode", "moe_a2a")
    description = ("Tutel: adaptive capacity (all-reduced max per-expert count), ep / dp / "
                   "adaptive switching over one expert layout, flat or 2-D hierarchical "
                   "all-to-all")
    dispatch_class: ClassVar[type] = TutelDispatch

    @classmethod
    def check(cls, case: CaseConfig) -> None:
        super().check(case)
        p = case.layout
        if case.options.expert.moe_a2a == "2d" and p.ep % RANKS_PER_NODE:
            raise ConfigError(f"ep={p.ep} with moe_a2a=2d: the 2-D all-to-all needs ep to be "
                              f"a multiple of the {RANKS_PER_NODE} ranks per node")

    def __init__(self, ctx):
        super().__init__(ctx)
        self.step_stats = TutelStepStats()

    def make_dispatch(self) -> TutelDispatch:
        plan = None
        if self.ctx.options.expert.moe_a2a == "2d":
            plan = self.two_dim_plan()
        return self.dispatch_class(self.ctx.model, self.ctx.mesh.group("ep"), self.ep,
                                   mode=self.ctx.options.expert.moe_mode, plan=plan)

    def two_dim_plan(self):
        return build_plan(self.ctx.mesh, self.ep, RANKS_PER_NODE)

    @classmethod
    def predict(cls, case: CaseConfig) -> Prediction:
        """The closed form (``analytic.expert_tutel``) on the reference router's counts of
        every step, routed in this scheme's groups: bytes and calls of every step (the timed
        ones included, issue 20), figures of the checked steps."""
        run = case.run
        counts = reference_loads(case, run.steps + run.timed_steps, cls.routing_groups(case))
        t = tutel_prediction(case, counts[:run.steps])
        every = tutel_prediction(case, counts) if run.timed_steps else t
        return Prediction(wire_bytes_by_step=every.wire, calls_by_step=every.calls,
                          model_state_bytes=[dict(t.states) for _ in range(case.layout.dp)],
                          figures=t.figures)

    def metrics(self) -> dict:
        out = row_metrics(self.step_stats, self.ctx, {})
        mine = self.step_stats.last(self.ctx.run.steps) or {}
        out["capacity_per_layer_microbatch"] = mine.get("capacities")
        out["mode_per_layer_microbatch"] = mine.get("modes")
        return {k: v for k, v in out.items() if not k.endswith("_predicted")}
