"""One MoE layer as Tutel runs it (Hwang et al. 2023, "Tutel: Adaptive Mixture-of-Experts at
Scale", MLSys 2023, arXiv 2206.03382): adaptive capacity, a per-layer choice between expert
and data parallelism over one parameter layout, and the flat or 2-D all-to-all.

**Adaptive capacity** (Tutel's dynamic capacity factor: its "dynamic workload" motivation and the
adaptive-capacity setting of its MoE layer). The router and the dropping order are the
reference's (``parbench.model.moe.route``). Each rank's need is the largest slot index + 1 among its
kept assignments (the largest per-expert count when nothing is dropped); one all-reduce (MAX,
one int64) over the ep group -- the ranks that exchange the buffer -- gives the capacity C of
this layer and micro-batch, and the dispatch buffer is ``[E, C, h]``. ``moe_capacity_factor
= 0``: no upper bound (the smallest buffer that drops nothing); ``cf > 0`` is Tutel's upper
bound on the factor: the reference's Switch capacity ceil(cf k T / E) caps C, the
assignments it drops are dropped exactly as the reference drops them (kept iff slot <
bound), and the buffer is min(bound, need) -- never larger than the static one.

**Parallelism switching** (Tutel, "Adaptive Parallelism Switching", zero-cost
switchable parallelism). The expert parameters keep one layout in every mode: rank j of an
ep group owns experts j E/ep .. (j+1) E/ep - 1 (the EP layout).

- ``ep``: tokens travel (dispatch / combine all-to-alls of the ``[E, C, h]`` buffer).
- ``dp``: parameters travel: the layer's experts are all-gathered over the ep group (as
  ZeRO-DP gathers a sharded layer, the paper's DP mode), every rank computes its own tokens
  with all E experts, no all-to-all; backward reduce-scatters (sums) the gathered experts'
  gradients back to their owners. The owner then holds sum over the ep group of dL_r/dW_e,
  as after the EP backward, so the modes mix freely and the step's edp all-reduce is shared.
- ``adaptive``: per layer and micro-batch, the mode whose bytes on the wire are fewer (ties:
  ep): ep costs 4 E C h (dispatch, combine, both gradients) times the all-to-all's wire factor
  ((W-1)/W flat; (L-1)/L + (N-1)/N for 2-D), dp costs 2 E P_e (gather, reduce-scatter; P_e =
  2 h f + f + h per expert) times (W-1)/W. Every input of the rule is agreed by the ep group
  (C after the all-reduce), so its ranks choose alike. (The paper picks by measured time
  from a per-capacity lookup; bytes are the deterministic stand-in.)
"""
from __future__ import annotations

from dataclasses import replace
from fractions import Fraction
from types import SimpleNamespace

import torch
import torch.distributed as dist

from parbench.model.moe import AttachAux, Routing, combine_reference, expert_from, expert_tensors

from .dispatch import ExpertDispatch, stats_of
from .hier_a2a import TwoDimAllToAll, TwoDimPlan


class GatherExperts(torch.autograd.Function):
    """All-gather of the ep group's flat expert shards forward; reduce-scatter (sum) of their
    gradients backward."""

    @staticmethod
    def forward(ctx, flat, group, ep):
        ctx.group, ctx.ep = group, ep
        out = flat.new_empty(ep * flat.numel())
        dist.all_gather_into_tensor(out, flat.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty(grad.numel() // ctx.ep)
        dist.reduce_scatter_tensor(out, grad.contiguous(), group=ctx.group)
        return out, None, None


#: one expert's tensors in the flat order: fc1 weight, fc1 bias, fc2 weight, fc2 bias
flat_expert = expert_tensors


def unflatten(full: torch.Tensor, like, num_experts: int) -> list[SimpleNamespace]:
    """``[E P_e]`` (experts in global order: rank-major, as the gather concatenates) -> E
    experts shaped like ``like`` (``.fc1.weight`` ...)."""
    shapes = [t.shape for t in flat_expert(like)]
    out = []
    for row in full.view(num_experts, -1):
        parts = [p.view(s) for p, s in zip(row.split([s.numel() for s in shapes]), shapes)]
        out.append(expert_from(parts, like))
    return out


class TutelDispatch(ExpertDispatch):
    """The steps of one MoE layer under Tutel (module docstring)."""

    gather_fn = GatherExperts

    def __init__(self, cfg, ep_group, ep: int, mode: str = "ep",
                 plan: TwoDimPlan | None = None):
        super().__init__(cfg, ep_group, ep)
        self.mode, self.plan = mode, plan

    # ---- adaptive capacity ----------------------------------------------------------------
    @staticmethod
    def local_need(r: Routing) -> int:
        """Slots this rank's buffer needs: the largest kept slot + 1."""
        kept = r.slot[r.kept]
        return int(kept.max()) + 1 if kept.numel() else 0

    def agree(self, need: int, device) -> int:
        """The ep group's largest need (one int64 all-reduce, MAX)."""
        if self.group is None:
            return need
        t = torch.tensor([need], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t.item())

    def capacity(self, r: Routing, device) -> int:
        """The layer's buffer capacity: agreed by the ep group unless pure dp (no buffer)."""
        need = self.local_need(r)
        return need if self.mode == "dp" else self.agree(need, device)

    # ---- the switch -----------------------------------------------------------------------
    def a2a_factor(self) -> Fraction:
        if self.plan is None:
            return Fraction(self.ep - 1, self.ep)
        n, loc = self.plan.nodes, self.plan.local
        return Fraction(loc - 1, loc) + Fraction(n - 1, n)

    def choose(self, capacity: int, num_experts: int, h: int, expert_numel: int) -> str:
        if self.mode != "adaptive":
            return self.mode
        ep_bytes = 4 * num_experts * capacity * h * self.a2a_factor()
        dp_bytes = 2 * num_experts * expert_numel * Fraction(self.ep - 1, self.ep)
        return "ep" if ep_bytes <= dp_bytes else "dp"

    # ---- exchanges ------------------------------------------------------------------------
    def exchange(self, buf: torch.Tensor) -> torch.Tensor:
        if self.group is None or self.plan is None:
            return super().exchange(buf)
        return TwoDimAllToAll.apply(buf, self.plan)

    def gather_experts(self, experts, num_experts: int) -> list:
        """All E experts of the layer, gathered over the ep group (differentiable)."""
        flat = torch.cat([t.reshape(-1) for ex in experts for t in flat_expert(ex)])
        if self.group is not None:
            flat = self.gather_fn.apply(flat, self.group, self.ep)
        return unflatten(flat, experts[0], num_experts)

    # ---- the layer --------------------------------------------------------------------------
    def __call__(self, x, router_weight, experts, first_expert, groups, aux_scale, bias=None):
        num_experts, groups = self.prologue(x, router_weight, experts, first_expert, groups)
        h = router_weight.shape[1]
        r = self.route(x, router_weight, groups, bias)
        cap = self.capacity(r, x.device)
        r = replace(r, capacity=cap, stats={**r.stats, "capacity": cap})
        numel = sum(t.numel() for t in flat_expert(experts[0]))
        mode = self.choose(cap, num_experts, h, numel)
        if mode == "ep":
            y, g = self.expert_parallel(x, r, experts, groups, num_experts)
        else:
            y, g = combine_reference(x, r, self.gather_experts(experts, num_experts)), 1
        y = AttachAux.apply(y, r.aux * aux_scale)
        return y, {**stats_of(r, g), "mode": mode}
