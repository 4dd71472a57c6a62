"""One pipeline stage of the reference GPT on one rank of the five-axis mesh.

It is Megatron 1D tensor parallelism (``impls.tensor.megatron_model``; optional sequence
parallelism) on the rank's context-parallel tokens, with two hooks filled in:

- **attention** (cp > 1): the rank holds the tokens ``positions`` of every sample (its cp
  rank's, from ``impls.context.layout``) and its a/t heads; the attention core is the
  context-parallel one named by ``cp_algorithm`` (all-gather, ring attention or Ulysses from
  ``impls.context``) on those heads;
- **MoE layers**: the experts are whole (expert-tp 1) and sharded over ep, the router is
  replicated. The tokens entering the layer are split over the tp ranks -- rank r routes the
  r-th contiguous block of positions of its tokens (under sequence parallelism that block is
  exactly its sequence shard, so nothing moves). Without sequence parallelism the input is
  replicated over tp: ``f`` (identity forward, all-reduce backward) before the split, and the
  rank's outputs, zero-padded to the full tokens, are summed over tp by ``g`` (all-reduce
  forward, identity backward) -- the dense MLP's two all-reduces, so a layer's tp traffic is
  the same whether its MLP is dense or MoE. The routed tokens are dispatched over ep by
  ``impls.expert.dispatch.moe_tokens`` (2 all-to-alls forward, 2 backward). The router's
  gradient is partial over tp (each rank routes its own tokens) and is summed over tp once
  per step (``tp_partial_params``).

This is the structure of the UB-Mesh traffic table (``parbench.analytic.traffic``): TP
all-reduces per layer, context parallelism by all-gather, EP all-to-alls of the tokens a tp
rank routes.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from parbench.model.moe import is_moe_layer

from impls.context.allgather import AllGatherCore, GatherGroup
from impls.context.ring import RingPeers
from impls.context.ulysses import UlyssesRingCore
from impls.expert.dispatch import moe_tokens
from impls.tensor.collectives import CopyToRegion, ReduceFromRegion
from impls.tensor.megatron_model import MegatronGPT, MegatronLayout
from impls.tensor.shards import Placement

#: the context-parallel attention of the hybrid (``ContextOptions.cp_algorithm``)
CP_KINDS = ("allgather", "ring-attention", "ulysses")


class HybridLayout(MegatronLayout):
    """Megatron's placements, with the router replicated over tp and experts whole."""

    def placement(self, name: str, shape: tuple) -> Placement:
        if ".mlp.router." in name or ".mlp.experts." in name:
            return Placement(name, shape)
        return super().placement(name, shape)


def build_core(kind: str, group, cp: int, every: list[torch.Tensor], clock, balance: str):
    """The context-parallel attention core over ``group``: q, k, v (b, n, heads, d) ->
    (b, n, heads d)."""
    if kind == "allgather":
        return AllGatherCore(GatherGroup(group, every, clock))
    if kind == "ring-attention":
        return UlyssesRingCore(None, 1, RingPeers(group, clock, balance))
    return UlyssesRingCore(group, cp, RingPeers(None, clock))


class HybridStage(MegatronGPT):
    """A pipeline stage (``stage`` = lo, hi, first, last) of the hybrid: tp shards, the
    rank's cp tokens, its experts."""

    layout_cls = HybridLayout

    def __init__(self, cfg, seed, *, tp_group, tp, tp_rank, sp, recompute, stage,
                 positions: torch.Tensor, core=None, ep_group=None, ep: int = 1,
                 ep_rank: int = 0, aux_scale: float = 1.0):
        self.ep, self.ep_rank = ep, ep_rank
        self.per_rank = cfg.num_experts // ep if cfg.num_experts else 0
        super().__init__(cfg, seed, tp_group, tp, tp_rank, sp=sp, recompute=recompute,
                         stage=stage)
        self.first_expert = ep_rank * self.per_rank
        self.ep_group = ep_group if ep > 1 else None
        self.core = core
        self.aux_scale = aux_scale
        self._positions = tuple(int(x) for x in positions)  # no tensor held between steps
        #: the last forward's routing statistics per MoE layer
        self.moe_stats: dict[int, dict] = {}
        self._experts = {i: self._expert_views(i) for i in range(self.lo, self.hi)
                         if is_moe_layer(cfg, i)}

    # ---- which parameters ------------------------------------------------------------------
    def keep(self, name: str) -> bool:
        if ".mlp.experts." not in name:
            return True
        e = int(name.split(".mlp.experts.")[1].split(".")[0])
        return self.ep_rank * self.per_rank <= e < (self.ep_rank + 1) * self.per_rank

    def _expert_views(self, i: int) -> list[nn.Module]:
        """This rank's experts of layer ``i`` as modules over the stage's own parameters."""
        out = []
        for e in range(self.first_expert, self.first_expert + self.per_rank):
            view = nn.Module()
            for lin in ("fc1", "fc2"):
                m = nn.Linear.__new__(nn.Linear)
                nn.Module.__init__(m)
                m.weight = self.p(f"blocks.{i}.mlp.experts.{e}.{lin}.weight")
                m.bias = self.p(f"blocks.{i}.mlp.experts.{e}.{lin}.bias")
                setattr(view, lin, m)
            out.append(view)
        return out

    def tp_partial_params(self) -> list[nn.Parameter]:
        """Parameters whose gradients are partial sums over tp: the routers (tokens split
        over tp) and, under sequence parallelism, every tp-replicated parameter."""
        out = [self.p(n) for n, pl in self.placements.items()
               if ".mlp.router." in n or (self.sp and pl.replicated and ".experts." not in n)]
        return out if self.tp > 1 else []

    def expert_params(self) -> list[nn.Parameter]:
        return [self.p(n) for n in self.placements if ".mlp.experts." in n]

    def dense_params(self) -> list[nn.Parameter]:
        return [self.p(n) for n in self.placements if ".mlp.experts." not in n]

    # ---- hooks --------------------------------------------------------------------------------
    def positions(self, s: int) -> torch.Tensor:
        return torch.tensor(self._positions, dtype=torch.long)

    def attention_core(self, qkv: torch.Tensor) -> torch.Tensor:
        if self.core is None:
            return super().attention_core(qkv)
        n, b, _ = qkv.shape
        hd = self.cfg.hidden_size // self.cfg.num_heads
        q, k, v = qkv.view(n, b, 3, self.heads, hd).permute(2, 1, 0, 3, 4).unbind(0)
        return self.core(q, k, v).transpose(0, 1)

    def mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        if i not in self._experts:
            return super().mlp(i, x)
        split = self.tp > 1 and not self.sp
        if split:
            x = CopyToRegion.apply(x, self.group)
            n = x.shape[0] // self.tp
            xs = x[self.rank * n:(self.rank + 1) * n]
        else:
            xs = x
        tokens = xs.reshape(-1, xs.shape[-1])  # [n, b, h] flattened position-major
        y, stats = moe_tokens(tokens, self.p(f"blocks.{i}.mlp.router.weight"),
                              self._experts[i], self.first_expert, self.cfg, None,
                              self.ep_group, self.ep, self.aux_scale)
        self.moe_stats[i] = stats
        y = y.view(xs.shape)
        if split:
            n = xs.shape[0]
            pad = (0, 0, 0, 0, self.rank * n, (self.tp - 1 - self.rank) * n)
            y = ReduceFromRegion.apply(F.pad(y, pad), self.group)
        return y
