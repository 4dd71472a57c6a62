"""Expert-parallel token dispatch: one MoE layer's tokens routed, sent to the ranks that hold
their experts with one all-to-all, computed there, sent back with a second all-to-all and
combined (GShard, Lepikhin et al. 2020, Sec. 2.2 and 3.2, Algorithm 2; Switch Transformer,
Fedus et al. 2021, Sec. 2.1-2.2).

``moe_tokens`` is the reusable entry point (the expert family and the hybrid schemes call it):

1. **Route** with ``parbench.model.moe.route`` (top-k, gates, capacity C per routing group, the
   deterministic dropping order, the Switch load-balancing and router z-losses).
2. **Dispatch buffer** ``[E, G C, h]``: expert e's slots of group g are rows g C .. g C + C - 1
   of ``buffer[e]``, filled in the routing's slot order; empty slots (an expert under its
   capacity) hold zeros; dropped assignments are not in it. G = 1 when one group is routed
   (one rank, one micro-batch -- the expert family), so the buffer is GShard's ``[E, C, h]``
   ("dispatched_expert_inputs").
3. **All-to-all** over the ep ranks: the buffer is cut along experts into ep blocks of E/ep
   experts; rank j holds experts j E/ep .. (j+1) E/ep - 1 (GShard's sharding of the E axis)
   and receives block j from every peer: ``[ep, E/ep, G C, h]``, source-major.
4. **Experts** run on their own tokens of every peer, ``[E/ep, ep G C, h]`` (padding rows
   included, as with a dense capacity buffer).
5. **All-to-all back** (the inverse permutation, the same message size) and **combine**:
   y_t = sum over kept assignments (t, e) of gate_te * expert_e(x_t); a token whose every
   assignment was dropped gets 0 and passes through the block's residual.
6. The auxiliary losses enter by gradient only: ``AttachAux(y, aux * aux_scale)``.

Each all-to-all is an autograd Function whose backward is the reverse all-to-all, so one MoE
layer costs 2 all-to-alls forward and 2 backward per micro-batch, each moving E G C h
elements per rank, (ep - 1)/ep of them to other ranks. With ``ep_group`` None or ep = 1
nothing is communicated. The steps are methods of :class:`ExpertDispatch` so that a variant
(the self-test's mutants) replaces exactly one of them.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from parbench.model.moe import AttachAux, Routing, expert_mlp, route, skew_of
from parbench.model.router import balance_choice, rule_of, select


def all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """One equal-split ``all_to_all_single`` of ``x`` along its first dimension."""
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x.contiguous(), group=group)
    return out


class AllToAll(torch.autograd.Function):
    """All-to-all forward; the reverse all-to-all (the same exchange of the gradients)
    backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_to_all(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_to_all(grad, ctx.group), None


class ExpertDispatch:
    """The steps of one MoE layer under expert parallelism (module docstring)."""

    exchange_fn = AllToAll

    def __init__(self, cfg, ep_group, ep: int):
        self.cfg, self.ep = cfg, ep
        self.group = ep_group if ep > 1 else None

    # ---- 1. routing ----------------------------------------------------------------------
    def route(self, x: torch.Tensor, router_weight: torch.Tensor, groups: torch.Tensor,
              bias: torch.Tensor | None = None) -> Routing:
        """The reference router (``parbench.model.moe.route``) with the model's rule and the
        router's balancing ``bias`` (None: none; ``parbench.model.router``)."""
        cfg = self.cfg
        return route(x, router_weight, groups, cfg.moe_top_k, cfg.moe_capacity_factor,
                     cfg.moe_aux_loss_coef, cfg.moe_z_loss_coef, *skew_of(cfg),
                     rule=rule_of(cfg), bias=bias, choose=self.select_experts,
                     counted_by=self.balance_experts)

    @staticmethod
    def select_experts(scores, k, rule, bias):
        """The router's choice and gates (``parbench.model.router.select``)."""
        return select(scores, k, rule, bias)

    @staticmethod
    def balance_experts(scores, top_e, k, rule, bias):
        """The experts the balancing loss counts (``parbench.model.router.balance_choice``)."""
        return balance_choice(scores, top_e, k, rule, bias)

    # ---- 2. the dispatch buffer ------------------------------------------------------------
    @staticmethod
    def slots(r: Routing, groups: torch.Tensor, num_experts: int):
        """(token, choice, flat row of ``[E * G * C]``) of every kept assignment, and G."""
        _, gidx = torch.unique(groups, return_inverse=True)
        g = int(gidx.max()) + 1 if gidx.numel() else 1
        tok, choice = r.kept.nonzero(as_tuple=True)
        row = (r.expert[tok, choice] * g + gidx[tok]) * r.capacity + r.slot[tok, choice]
        return tok, choice, row, g

    def dispatch(self, x: torch.Tensor, tok: torch.Tensor, row: torch.Tensor, rows: int
                 ) -> torch.Tensor:
        """``[E * G * C, h]``: each kept assignment's token at its slot, zeros elsewhere."""
        return x.new_zeros(rows, x.shape[1]).index_copy(0, row, x[tok])

    # ---- 3-5. exchange, experts, exchange back -----------------------------------------------
    def exchange(self, buf: torch.Tensor) -> torch.Tensor:
        """``[E, G C, h]`` out, ``[ep, E/ep, G C, h]`` (source-major) in."""
        if self.group is None:
            return buf
        return self.exchange_fn.apply(buf, self.group)

    def to_local(self, recv: torch.Tensor) -> torch.Tensor:
        """``[ep, E/ep, G C, h]`` -> ``[E/ep, ep G C, h]``: each local expert's rows from every
        peer."""
        ep, n, gc, h = recv.shape
        return recv.transpose(0, 1).reshape(n, ep * gc, h)

    def from_local(self, out: torch.Tensor, ep: int) -> torch.Tensor:
        """The inverse of ``to_local``: ``[E/ep, ep G C, h]`` -> ``[ep, E/ep, G C, h]``."""
        n, rows, h = out.shape
        return out.reshape(n, ep, rows // ep, h).transpose(0, 1).contiguous()

    @staticmethod
    def run_experts(local: torch.Tensor, experts) -> torch.Tensor:
        return torch.stack([expert_mlp(local[i], ex.fc1, ex.fc2)
                            for i, ex in enumerate(experts)])

    # ---- 5. combine ----------------------------------------------------------------------
    def combine(self, x: torch.Tensor, back: torch.Tensor, r: Routing, tok, choice, row
                ) -> torch.Tensor:
        """y_t = sum over kept (t, e) of gate_te * expert_e(x_t)."""
        out = back.reshape(-1, x.shape[1])[row]
        out = out * r.gate[tok, choice].unsqueeze(1).to(x.dtype)
        return torch.zeros_like(x).index_add(0, tok, out)

    # ---- the layer -------------------------------------------------------------------------
    def __call__(self, x, router_weight, experts, first_expert, groups, aux_scale, bias=None):
        num_experts, groups = self.prologue(x, router_weight, experts, first_expert, groups)
        r = self.route(x, router_weight, groups, bias)
        y, g = self.expert_parallel(x, r, experts, groups, num_experts)
        y = AttachAux.apply(y, r.aux * aux_scale)
        return y, stats_of(r, g)

    def prologue(self, x, router_weight, experts, first_expert, groups):
        """The layer's argument check (this rank holds E/ep experts, from a multiple of E/ep)
        and its routing groups; returns ``(num_experts, groups)``."""
        num_experts = router_weight.shape[0]
        local = num_experts // self.ep
        if len(experts) != local or first_expert % max(local, 1):
            raise ValueError(f"{len(experts)} experts from {first_expert}: expected E/ep="
                             f"{local} from a multiple of {local}")
        return num_experts, routing_groups(x, groups)

    def expert_parallel(self, x, r: Routing, experts, groups, num_experts: int):
        """Dispatch buffer ``[E, C, h]``, exchange, local experts, exchange back, combine;
        returns ``(y, number of routing groups)``."""
        tok, choice, row, g = self.slots(r, groups, num_experts)
        buf = self.dispatch(x, tok, row, num_experts * g * r.capacity)
        recv = self.exchange(buf.view(num_experts, g * r.capacity, x.shape[1]))
        recv = recv.reshape(self.ep, num_experts // self.ep, g * r.capacity, x.shape[1])
        out = self.run_experts(self.to_local(recv), experts)
        back = self.exchange(self.from_local(out, self.ep).reshape(num_experts, -1,
                                                                   x.shape[1]))
        return self.combine(x, back, r, tok, choice, row), g


def routing_groups(x: torch.Tensor, groups: torch.Tensor | None) -> torch.Tensor:
    """The routing-group id of each token of ``x``; None: one group."""
    if groups is None:
        return torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
    return groups


def stats_of(r: Routing, groups: int) -> dict:
    """The routing's statistics as plain numbers (nothing a memory tracker would count)."""
    st = r.stats
    return {"load": [int(v) for v in st["load"]], "dropped": [int(v) for v in st["dropped"]],
            "aux_loss": float(st["aux_loss"]), "z_loss": float(st["z_loss"]),
            "capacity": int(st["capacity"]), "groups": groups}


def moe_tokens(x: torch.Tensor, router_weight: torch.Tensor, experts, first_expert: int, cfg,
               groups: torch.Tensor | None, ep_group, ep: int, aux_scale: float,
               dispatch: ExpertDispatch | None = None, expert_bias: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, dict]:
    """One MoE layer on ``x`` ``[T, h]`` (tokens in priority order, position-major) under
    expert parallelism; returns ``(y [T, h], stats)``.

    ``router_weight`` ``[E, h]`` is replicated; ``experts`` are this rank's E/ep expert modules
    (each with ``.fc1`` and ``.fc2``, like ``parbench.model.MLP``), global ids
    ``first_expert .. first_expert + E/ep - 1``; ``groups`` ``[T]`` the routing-group ids (None:
    one group); ``ep_group`` the process group the experts are sharded over (None or ep = 1: no
    communication); ``aux_scale`` multiplies the layer's auxiliary loss term. Numerically equal
    to ``parbench.model.moe.MoE`` on the same tokens and groups. ``stats``: per-expert ``load`` and
    ``dropped`` counts, ``aux_loss``, ``z_loss`` (unscaled means over the groups), ``capacity``
    and the number of ``groups``. ``dispatch`` replaces the steps (default
    :class:`ExpertDispatch`); ``expert_bias`` the router's balancing bias (None: none).
    """
    d = dispatch or ExpertDispatch(cfg, ep_group, ep)
    return d(x, router_weight, experts, first_expert, groups, aux_scale, expert_bias)
