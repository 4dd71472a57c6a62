"""``expert.fastermoe``: dropless expert parallelism with FasterMoE's shadow experts (He, Zhai,
Antunes, Wang, Luo, Shi and Li 2022, "FasterMoE", PPoPP'22, Sec. 4 "shadowing").

Popular experts are replicated for the duration of one MoE layer's micro-batch: their
parameters are broadcast from the owner to every rank of the ep group, each rank computes its
own tokens for them locally instead of sending them, and the copies' gradients are reduced
back to the owner. One MoE layer (:class:`ShadowDispatch`):

1. **Route** and sort by expert as ``expert.dropless`` (capacity factor 0, nothing dropped).
2. **Counts**: one all-gather of the rank's per-expert counts over ep: every rank holds the
   ``[ep, E]`` matrix -- the global counts and every split size of step 5.
3. **Choose** the ``moe_shadow`` = S most popular experts of this layer and micro-batch by the
   counts summed over the ep group, ties to the lower expert id: every rank computes the same
   set from the same matrix (FasterMoE decides per iteration from the global counts; its
   performance model picks how many, here S is given).
4. **Broadcast** each shadow's parameters (one flat buffer of its fc1 / fc2 weights and biases)
   from its owner; every rank, the owner included, computes its tokens for that expert with
   the broadcast copy, a leaf tensor of its own.
5. The other tokens go through ``expert.dropless``'s uneven all-to-alls, the shadowed
   experts' counts taken out of the splits (their tokens stay home).
6. **Reduce**: after the step's backward passes, each copy's gradient is summed onto its
   owner (``dist.reduce``, one call per shadow, layer and micro-batch, in the order the
   shadows were made -- the same on every rank) and added to the owner's expert gradient;
   then ``expert.alltoall``'s gradient all-reduces. Summing is linear, so reducing after the
   last micro-batch instead of inside each layer's backward (FasterMoE overlaps it) gives the
   same gradients and the same bytes.

With ep = 1 there is nothing to shadow: the layer is ``expert.dropless``'s. Closed forms:
``parbench.analytic.expert_shadow``.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import ClassVar

import torch
import torch.distributed as dist

from parbench.analytic.expert_shadow import shadow_prediction
from parbench.config import CaseConfig, ConfigError
from parbench.model.moe import AttachAux, expert_from, expert_mlp, expert_tensors
from parbench.scheme import Prediction, register

from .dispatch import routing_groups, stats_of
from .dropless import DroplessDispatch, ExpertDropless, routed_prediction
from .scheme import MOE_OPTIONS


#: one expert's tensors in the flat buffer's order (fc1 weight, bias, fc2 weight, bias)
expert_params = expert_tensors


class ShadowDispatch(DroplessDispatch):
    """The steps of one MoE layer with shadow experts (module docstring)."""

    def __init__(self, cfg, ep_group, ep: int, shadows: int):
        super().__init__(cfg, ep_group, ep)
        self.shadows = shadows
        self.ep_rank = dist.get_rank(ep_group) if self.group is not None else 0
        #: (owner's ep rank, the copy, the owner's expert or None) per shadow made this step
        self.pending: list[tuple[int, torch.Tensor, object]] = []

    # ---- 2-3. counts and the choice ----------------------------------------------------------
    def gather_counts(self, counts: torch.Tensor) -> torch.Tensor:
        out = counts.new_empty(self.ep * counts.numel())
        dist.all_gather_into_tensor(out, counts.contiguous(), group=self.group)
        return out.view(self.ep, -1)

    def choose_shadows(self, all_counts: torch.Tensor) -> list[int]:
        total = all_counts.sum(0).tolist()
        ranked = sorted(range(len(total)), key=lambda x: (-total[x], x))
        return sorted(ranked[:self.shadows])

    # ---- 4. the copies -----------------------------------------------------------------------
    def fetch_shadow(self, expert: int, experts, first_expert: int, key) -> torch.Tensor:
        """The flat parameters of ``expert``, broadcast from its owner: a new leaf (``key``:
        the layer's router weight, naming the layer)."""
        local = len(experts)
        own = expert // local
        mine = experts[expert - first_expert] if own == self.ep_rank else None
        if mine is not None:
            flat = torch.cat([p.detach().reshape(-1) for p in expert_params(mine)])
        else:
            flat = torch.empty(sum(p.numel() for p in expert_params(experts[0])),
                               dtype=experts[0].fc1.weight.dtype,
                               device=experts[0].fc1.weight.device)
        dist.broadcast(flat, src=dist.get_global_rank(self.group, own), group=self.group)
        leaf = flat.requires_grad_()
        self.pending.append((own, leaf, mine))
        return leaf

    @staticmethod
    def as_expert(flat: torch.Tensor, like) -> SimpleNamespace:
        """``flat`` viewed as an expert with ``like``'s shapes (``fc1`` / ``fc2``)."""
        parts, off = [], 0
        for p in expert_params(like):
            parts.append(flat[off:off + p.numel()].view_as(p))
            off += p.numel()
        return expert_from(parts, like)

    # ---- 6. the gradients back to the owners -------------------------------------------------
    def reduce_shadow_grads(self) -> None:
        for own, leaf, mine in self.pending:
            grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            dist.reduce(grad, dst=dist.get_global_rank(self.group, own), group=self.group)
            if mine is not None:
                self.add_to_owner(grad, mine)
        self.pending.clear()

    @staticmethod
    def add_to_owner(grad: torch.Tensor, mine) -> None:
        off = 0
        for p in expert_params(mine):
            p.grad.add_(grad[off:off + p.numel()].view_as(p))
            off += p.numel()

    # ---- the layer ---------------------------------------------------------------------------
    def __call__(self, x, router_weight, experts, first_expert, groups, aux_scale, bias=None):
        if self.group is None:
            return super().__call__(x, router_weight, experts, first_expert, groups, aux_scale,
                                    bias)
        num_experts = router_weight.shape[0]
        local = num_experts // self.ep
        groups = routing_groups(x, groups)
        r = self.route(x, router_weight, groups, bias)
        tok, choice, counts = self.sort_by_expert(r, num_experts)
        all_counts = self.gather_counts(counts)
        chosen = self.choose_shadows(all_counts)
        assigned = r.expert[tok, choice]
        shadowed = torch.zeros_like(assigned, dtype=torch.bool)
        y = torch.zeros_like(x)
        for e in chosen:
            copy = self.as_expert(self.fetch_shadow(e, experts, first_expert, router_weight),
                                  experts[0])
            here = assigned == e
            shadowed |= here
            out = expert_mlp(x[tok[here]], copy.fc1, copy.fc2)
            y = y + self.combine_rows(x, out, r, tok[here], choice[here])
        counts, all_counts = counts.clone(), all_counts.clone()
        counts[chosen] = 0
        all_counts[:, chosen] = 0
        recv_counts = all_counts[:, self.ep_rank * local:(self.ep_rank + 1) * local]
        send = counts.view(self.ep, local).sum(1).tolist()
        recv = recv_counts.sum(1).tolist()
        rest_tok, rest_choice = tok[~shadowed], choice[~shadowed]
        got = self.exchange_tokens(x[rest_tok], send, recv)
        back = self.exchange_tokens(self.run_grouped(got, recv_counts, experts), recv, send)
        y = y + self.combine_rows(x, back, r, rest_tok, rest_choice)
        y = AttachAux.apply(y, r.aux * aux_scale)
        return y, stats_of(r, int(r.stats["groups"]))


@register
class ExpertFasterMoE(ExpertDropless):
    name = "expert.fastermoe"
    description = ("FasterMoE shadow experts: the moe_shadow most popular experts broadcast to "
                   "every ep rank and computed locally, their gradients reduced to the owner; "
                   "the other tokens dropless")
    options: ClassVar[tuple[str, ...]] = MOE_OPTIONS + ("moe_shadow",)
    shown_figures = ("shadow_a2a_wire_bytes_all_ranks", "dropless_a2a_wire_bytes_all_ranks",
                     "dropless_ep_wire_bytes_all_ranks", "alltoall_padded_ep_wire_bytes_all_ranks",
                     "shadow_a2a_vs_dropless")

    @classmethod
    def check(cls, case: CaseConfig) -> None:
        super().check(case)
        s, e = case.options.expert.moe_shadow, case.model.num_experts
        if s > e:
            raise ConfigError(f"moe_shadow={s}: cannot shadow more experts than there are "
                              f"(num_experts={e}); set moe_shadow <= {e}")

    dispatch_class = ShadowDispatch

    def make_dispatch(self) -> ShadowDispatch:
        return self.dispatch_class(self.ctx.model, self.ctx.mesh.group("ep"), self.ep,
                                   self.ctx.options.expert.moe_shadow)

    def reduce_expert_gradients(self) -> None:
        """The shadows' gradients onto their owners, then ``expert.alltoall``'s edp sum / dp."""
        self.dispatch.reduce_shadow_grads()
        super().reduce_expert_gradients()

    @classmethod
    def predict(cls, case: CaseConfig) -> Prediction:
        return routed_prediction(case, shadow_prediction, cls.routing_groups(case),
                                 shadows=case.options.expert.moe_shadow)
