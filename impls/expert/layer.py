"""The reference model on one expert-parallel rank: every dense parameter, and of every MoE
layer the router and this rank's E/ep experts.

``localize`` takes the whole reference model (``parbench.model.build_model``: the seeded
weights and global names of the golden run) and replaces each MoE layer's ``mlp`` by an
:class:`ExpertParallelMoE` holding the same router and the experts
``ep_rank E/ep .. (ep_rank+1) E/ep - 1`` under their global names
(``blocks.{i}.mlp.experts.{e}.fc1.weight``, ...); the other experts are dropped. The router's
balancing bias (``mlp.router.expert_bias``) and the shared expert (``mlp.shared_expert``,
DeepSeek-V3 Eq. 12) come along whole: they are dense, replicated on every rank.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from parbench.model.moe import MoE
from parbench.model.router import bias_of

from .dispatch import ExpertDispatch, moe_tokens


def is_expert_param(name: str) -> bool:
    """Parameters sharded over ep and replicated over edp (the rest is replicated over dp)."""
    return ".mlp.experts." in name


class ExpertParallelMoE(nn.Module):
    """An MoE layer whose experts are sharded over the ep ranks. Input ``[b, s, h]``; the
    tokens are routed position-major (``[s, b]`` flattened, the reference's priority order)
    as one routing group."""

    def __init__(self, moe: MoE, first: int, count: int, dispatch: ExpertDispatch):
        super().__init__()
        self.cfg = moe.cfg
        self.router = moe.router
        self.shared_expert = moe.shared_expert if moe.cfg.moe_shared_expert_size else None
        self.experts = nn.ModuleDict({str(e): moe.experts[e]
                                      for e in range(first, first + count)})
        self.first = first
        self.dispatch = dispatch
        #: multiplies this layer's auxiliary terms (1/m: ``parbench.model.moe``)
        self.aux_scale = 1.0
        #: routing statistics of every forward since the last ``take_stats`` (plain numbers)
        self.stats: list[dict] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        xt = x.transpose(0, 1).reshape(s * b, h)
        y, stats = moe_tokens(xt, self.router.weight, list(self.experts.values()), self.first,
                              self.cfg, None, self.dispatch.group, self.dispatch.ep,
                              self.aux_scale, dispatch=self.dispatch,
                              expert_bias=bias_of(self.router))
        self.stats.append(stats)
        if self.shared_expert is not None:
            y = y + self.shared_expert(xt)
        return y.view(s, b, h).transpose(0, 1)

    def take_stats(self) -> list[dict]:
        out, self.stats = self.stats, []
        return out


def localize(model: nn.Module, ep_rank: int, ep: int, dispatch: ExpertDispatch) -> nn.Module:
    """Replace every MoE layer of ``model`` by its expert-parallel shard (in place)."""
    for blk in model.blocks.values():
        if isinstance(blk.mlp, MoE):
            count = blk.mlp.cfg.num_experts // ep
            blk.mlp = ExpertParallelMoE(blk.mlp, ep_rank * count, count, dispatch)
    return model


def moe_layers(model: nn.Module) -> list[ExpertParallelMoE]:
    return [m for m in model.modules() if isinstance(m, ExpertParallelMoE)]
