"""Realistic bugs in the expert-parallel family (see mutants_data): each mutant replaces one
step of ``expert.alltoall`` -- the expert-gradient reduction, the combine, the dispatch
buffer's expert -> rank layout, the capacity, the auxiliary loss scale, the all-to-alls --
and registers as a scheme of its own."""
from __future__ import annotations

import torch
import torch.distributed as dist

from parbench.model.moe import route

from impls.expert.dispatch import ExpertDispatch, all_to_all
from impls.expert.scheme import ExpertAllToAll

from .catalogue import mutant

# ---- the expert-gradient reduction -------------------------------------------------------------


@mutant("ep-edp-mean", base="expert.alltoall",
        bug="expert gradients averaged over the edp replicas (/ edp) instead of summed and "
            "divided by dp: each expert's gradient is ep times too large")
class ExpertGradsMeanOverEdp(ExpertAllToAll):
    def reduce_expert_gradients(self):
        if self.edp > 1:
            dist.all_reduce(self.experts.buffer, group=self.ctx.mesh.group("edp"))
        self.experts.buffer.div_(self.edp)


@mutant("ep-edp-unreduced", base="expert.alltoall", overrides={"dp": "4"},
        bug="expert gradients not all-reduced over the edp replicas: each replica steps on "
            "its own ep group's tokens only")
class ExpertGradsNotReduced(ExpertAllToAll):
    def reduce_expert_gradients(self):
        self.experts.buffer.div_(self.dp)


# ---- the MoE layer's steps ---------------------------------------------------------------------


class _NoGateCombine(ExpertDispatch):
    def combine(self, x, back, r, tok, choice, row):
        out = back.reshape(-1, x.shape[1])[row]  # the bug: the gate is never applied
        return torch.zeros_like(x).index_add(0, tok, out)


@mutant("ep-combine-no-gate", base="expert.alltoall",
        bug="combine sums the expert outputs without multiplying by the gate (the router "
            "gets no gradient from the task loss)")
class CombineIgnoresGate(ExpertAllToAll):
    dispatch_class = _NoGateCombine


class _ExpertMajorLayout(ExpertDispatch):
    def to_local(self, recv):
        ep, n, gc, h = recv.shape
        return recv.reshape(n, ep * gc, h)  # the bug: read as [E/ep, ep, G C, h]

    def from_local(self, out, ep):
        n, rows, h = out.shape
        return out.reshape(ep, n, rows // ep, h)


@mutant("ep-dispatch-layout", base="expert.alltoall",
        bug="received all-to-all buffer read expert-major ([E/ep, ep, C, h]) instead of "
            "source-major ([ep, E/ep, C, h]): local experts compute on another expert's tokens")
class WrongDispatchLayout(ExpertAllToAll):
    dispatch_class = _ExpertMajorLayout


class _GlobalCapacity(ExpertDispatch):
    world = 1  # the dp degree

    def route(self, x, router_weight, groups, bias=None):
        cfg = self.cfg
        # the bug: capacity from the global batch's tokens (T dp) instead of the rank's T
        return route(x, router_weight, groups, cfg.moe_top_k,
                     cfg.moe_capacity_factor * self.world, cfg.moe_aux_loss_coef,
                     cfg.moe_z_loss_coef)


@mutant("ep-global-capacity", base="expert.alltoall",
        bug="capacity computed from the global token count (ceil(cf k T dp / E)) instead of "
            "the rank's routing group: fewer tokens dropped, a dp-times larger buffer")
class GlobalCapacity(ExpertAllToAll):
    def make_dispatch(self):
        d = _GlobalCapacity(self.ctx.model, self.ctx.mesh.group("ep"), self.ep)
        d.world = self.dp
        return d


@mutant("ep-aux-unscaled", base="expert.alltoall",
        bug="auxiliary loss of each micro-batch not divided by m: the load-balancing loss "
            "weighs m times too much")
class AuxNotScaled(ExpertAllToAll):
    def aux_scale(self, m):
        return 1.0


class _DebugCounts(ExpertDispatch):
    def exchange(self, buf):
        if self.group is not None:  # the bug: a leftover exchange of the per-expert counts
            counts = (buf.detach().abs().sum(-1) > 0).sum(-1).to(torch.int64)
            all_to_all(counts, self.group)
        return super().exchange(buf)


@mutant("ep-debug-alltoall", base="expert.alltoall",
        bug="a leftover debug all-to-all of the per-expert slot counts before each forward "
            "exchange: results unchanged, two extra all-to-alls per MoE layer")
class DebugAllToAll(ExpertAllToAll):
    dispatch_class = _DebugCounts
