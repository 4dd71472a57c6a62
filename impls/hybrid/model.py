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
- **DeepSeek-V3's MoE blocks** (arXiv 2412.19437, Sec. 2.1.2; ``deepseek-tiny``): fine-grained
  experts, the sigmoid router, group-limited routing and the routed scaling are the reference
  router's rule inside ``moe_tokens``; the router's balancing bias is ``balance.ExpertBias``.
  The shared expert (Eq. 12) is kept whole on every tp rank, like the router, and runs on
  the rank's routed tokens; its output joins the routed one before ``g``, so it adds no
  activation traffic, and its gradient, partial over tp, joins the tp sum once per step.
  Megatron-Core instead shards it over tp as a dense MLP (megatron/core/transformer/moe/
  shared_experts.py: ``SharedExpertMLP`` is an ``MLP`` of column- and row-parallel linears on
  the tensor-parallel group) -- a choice of where the shared expert's h x f_s x 2 weights
  live, not of the arithmetic. Over dp x cp it is a dense parameter (``dp_cp``).

The LLaMA blocks (RoPE, grouped-query attention, SwiGLU, RMSNorm, no biases) are the
Megatron stage's (query groups split over tp, gathered when tp > num_kv_heads); with cp > 1
the core gets K/V at their own g/t heads and q, k rotated at the tokens' global positions in
the sample, or within-document ones when packed (``HybridStage.cp_heads``; the local
positions 0..s/cp-1 of a chunk are the classic bug).

This is the structure of the UB-Mesh traffic table (``parbench.analytic.traffic``): TP
all-reduces per layer, context parallelism by all-gather, EP all-to-alls of the tokens a tp
rank routes.

A stage is called with the micro-batch's whole samples (tokens and targets over the full
sequence, as the pipeline executor holds them) and takes its cp positions itself: the first
stage embeds its tokens' columns, the last scores its targets' columns. So the executor finds
a packed micro-batch's documents in the tokens every rank holds and hands them to every stage
(``impls.pipeline.executor``), as it does for the pipeline family:

- **packed documents** (``pack_docs``; Megatron-LM's --reset-position-ids /
  --reset-attention-mask): the learned positions are the within-document positions of the
  rank's columns; attention is masked within documents -- with cp = 1 by the Megatron
  stage's own mask, with cp > 1 by a core that declares ``supports_packing``
  (:class:`HybridGatherCore`: the gathered keys' documents, bound to the micro-batch at its
  forward so that a backward run later under the schedule masks with the same ones). A core
  that declares it is called with the micro-batch's whole ``Documents`` as ``docs``; the
  scheme refuses ``pack_docs`` with cp > 1 for a core that does not (``core_packs``);
- **a masked loss** (``loss_mask``, ``summed_loss``): the last stage returns the sum of its
  counted tokens' losses (the vocab-parallel cross-entropy's per-token output masked, as
  ``MegatronGPT.token_mean``), not their mean -- a cp shard may hold prompt tokens only --
  and the scheme scales it by dp cp / N (``scheme.HybridExecutor``);
- **tied embeddings** across stages: a last stage that does not hold the embedding keeps its
  tp shard of the output layer as a copy of the word embedding's shard, initialised from the
  embedding's seed (``impls.pipeline.tied``: ``tied_copies``, ``embedding_init``).
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from parbench.model import IGNORE_INDEX
from parbench.model.blocks import rotate
from parbench.model.moe import expert_mlp, is_moe_layer
from parbench.model.packing import documents_of

from impls.context.allgather import AllGatherAttention, AllGatherCore, GatherGroup
from impls.context.ring import RingPeers
from impls.context.ulysses import UlyssesRingCore
from impls.expert.dispatch import moe_tokens
from impls.pipeline.tied import EMBED, HEAD, embedding_init
from impls.tensor.collectives import CopyToRegion, ReduceFromRegion
from impls.tensor.megatron_model import MegatronGPT, MegatronLayout
from impls.tensor.shards import Placement, take

from .balance import ExpertBias


class HybridGatherCore(AllGatherCore):
    """All-gather CP (``impls.context.allgather``) that masks packed documents: each call
    binds the micro-batch's documents to its own copy of the gather group, which the
    autograd node keeps, so the backward masks with them whenever the schedule runs it."""

    #: masks the gathered keys with the micro-batch's documents
    supports_packing = True

    def __call__(self, q, k, v, docs=None):
        b, n, heads, d = q.shape
        g = self.g
        if docs is not None:
            g = copy.copy(self.g)
            g.docs = docs
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        out = AllGatherAttention.apply(q, k, v, g)
        return out.transpose(1, 2).reshape(b, n, heads * d)


#: the context-parallel attention core of each ``ContextOptions.cp_algorithm`` of the hybrid
CORE_CLASSES = {"allgather": HybridGatherCore, "ring-attention": UlyssesRingCore,
                "ulysses": UlyssesRingCore}
CP_KINDS = tuple(CORE_CLASSES)


def core_packs(kind: str) -> bool:
    """Does the core of ``cp_algorithm=kind`` mask packed documents (its class declares
    ``supports_packing``)?"""
    return bool(getattr(CORE_CLASSES[kind], "supports_packing", False))


class HybridLayout(MegatronLayout):
    """Megatron's placements, with the router replicated over tp and the routed and shared
    experts whole (``HybridStage.mlp``)."""

    def placement(self, name: str, shape: tuple) -> Placement:
        if any(k in name for k in (".mlp.router.", ".mlp.experts.", ".mlp.shared_expert.")):
            return Placement(name, shape)
        return super().placement(name, shape)


def build_core(kind: str, group, cp: int, every: list[torch.Tensor], clock, balance: str):
    """The context-parallel attention core over ``group``: q, k, v (b, n, heads, d) ->
    (b, n, heads d)."""
    cls = CORE_CLASSES[kind]
    if kind == "allgather":
        return cls(GatherGroup(group, every, clock))
    if kind == "ring-attention":
        return cls(None, 1, RingPeers(group, clock, balance))
    return cls(group, cp, RingPeers(None, clock))


class HybridStage(MegatronGPT):
    """A pipeline stage (``stage`` = lo, hi, first, last) of the hybrid: tp shards, the
    rank's cp tokens, its experts."""

    layout_cls = HybridLayout

    def __init__(self, cfg, seed, *, tp_group, tp, tp_rank, sp, recompute, stage,
                 positions: torch.Tensor, core=None, ep_group=None, ep: int = 1,
                 ep_rank: int = 0, aux_scale: float = 1.0, summed_loss: bool = False):
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
        #: DeepSeek-V3's shared expert of each MoE layer (Eq. 12), whole on every rank
        self._shared = {i: self._mlp_view(f"blocks.{i}.mlp.shared_expert")
                        for i in self._experts} if cfg.moe_shared_expert_size else {}
        #: the routers' balancing biases and the step's loads (``balance``)
        self.balance = ExpertBias(sorted(self._experts), cfg.num_experts,
                                  cfg.moe_bias_update_rate, recompute)
        #: the loss is the sum over the counted tokens (``loss_mask``), not their mean
        self.summed_loss = summed_loss
        # the output layer is the embedding only where this stage holds both; a last stage
        # without the embedding keeps its own copy of it (``tied_copies``)
        self.tied = self.tied and self.first
        if cfg.tie_embeddings and self.last and not self.first:
            self._init_head_copy(seed)

    def _init_head_copy(self, seed: int) -> None:
        """This rank's shard of the output-layer copy of a tied embedding: the embedding's
        initial weights (its seed), the rows its vocabulary placement gives it."""
        w, pl = self.p(HEAD), self.placements[HEAD]
        with torch.no_grad():
            w.copy_(take(embedding_init(pl.full_shape, seed, self.cfg.init_std),
                         pl.index(self.rank)))

    def tied_copies(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(embedding shard, output-layer copy shard) of a tied weight this stage holds
        (``impls.pipeline.tied``)."""
        if not self.cfg.tie_embeddings:
            return None, None
        return (self.p(EMBED) if self.first else None,
                self.p(HEAD) if self.last and not self.first else None)

    # ---- which parameters ------------------------------------------------------------------
    def keep(self, name: str) -> bool:
        if ".mlp.experts." not in name:
            return True
        e = int(name.split(".mlp.experts.")[1].split(".")[0])
        return self.ep_rank * self.per_rank <= e < (self.ep_rank + 1) * self.per_rank

    def _expert_views(self, i: int) -> list[nn.Module]:
        """This rank's experts of layer ``i`` as modules over the stage's own parameters."""
        return [self._mlp_view(f"blocks.{i}.mlp.experts.{e}")
                for e in range(self.first_expert, self.first_expert + self.per_rank)]

    def _mlp_view(self, prefix: str) -> nn.Module:
        """An MLP (``.fc1``, ``.fc2``; GELU, or SwiGLU with fc1 [gate; up], biases where the
        model has them) over the stage's parameters ``prefix.fc1.weight``, ...: an expert
        for ``expert_mlp``."""
        view = nn.Module()
        for lin in ("fc1", "fc2"):
            m = nn.Linear.__new__(nn.Linear)
            nn.Module.__init__(m)
            m.weight = self.p(f"{prefix}.{lin}.weight")
            m.bias = self.p(f"{prefix}.{lin}.bias") if self.cfg.bias else None
            setattr(view, lin, m)
        return view

    def tp_partial_params(self) -> list[nn.Parameter]:
        """Parameters whose gradients are partial sums over tp: the routers and shared
        experts (tokens split over tp) and, under sequence parallelism, every tp-replicated
        parameter."""
        out = [self.p(n) for n, pl in self.placements.items()
               if ".mlp.router." in n or ".mlp.shared_expert." in n
               or (self.sp and pl.replicated and ".experts." not in n)]
        return out if self.tp > 1 else []

    def expert_params(self) -> list[nn.Parameter]:
        return [self.p(n) for n in self.placements if ".mlp.experts." in n]

    def dense_params(self) -> list[nn.Parameter]:
        return [self.p(n) for n in self.placements if ".mlp.experts." not in n]

    # ---- hooks --------------------------------------------------------------------------------
    def positions(self, s: int) -> torch.Tensor:
        return torch.tensor(self._positions, dtype=torch.long)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor, docs=None) -> torch.Tensor:
        """``tokens`` (first stage) and ``targets`` of the micro-batch's whole samples, or
        hidden states of the rank's tokens (a later stage); ``docs``: the whole samples'
        documents (packed). The stage takes its cp positions' columns."""
        cols = self.positions(0).to(targets.device)
        if self.first:
            if docs is None:
                docs = documents_of(self.cfg, tokens)
            tokens = tokens[:, cols]
        return super().forward(tokens, targets[:, cols] if self.last else targets, docs)

    def embed(self, tokens: torch.Tensor, docs=None) -> torch.Tensor:
        """The Megatron embedding of the rank's tokens, at their within-document positions
        when packed (the rank's columns of ``docs``)."""
        cols = self.positions(0).to(tokens.device)
        return super().embed(tokens, None if docs is None else docs.take(cols))

    def attention_core(self, qkv: torch.Tensor, docs=None) -> torch.Tensor:
        """The rank's heads' attention: Megatron's own (cp = 1; within ``docs`` when packed)
        or the cp core's (handed the documents if it masks them, ``core_packs``)."""
        if self.core is None:
            return super().attention_core(qkv, docs)
        q, k, v = self.cp_heads(qkv, docs)
        extra = {} if docs is None else {"docs": docs}
        return self.core(q, k, v, **extra).transpose(0, 1)

    def rope_positions(self, docs=None) -> torch.Tensor:
        """The positions RoPE rotates the rank's tokens at: their global positions in the
        sample (``impls.context.layout``), or with packed ``docs`` their within-document
        positions (the rank's columns of ``docs.pos``, as the golden run restarts them)."""
        cols = self.positions(0)
        return cols if docs is None else docs.pos[:, cols.to(docs.pos.device)]

    def cp_heads(self, qkv: torch.Tensor, docs=None):
        """q (b, n, a/t, d) and k, v (b, n, g/t, d) of the rank's cp tokens from its local
        [q; k; v] columns [n, b, (a + 2g) d / t]: K/V at their own heads (grouped-query
        attention: the cp cores move and serve the g/t K/V heads, ``impls.context.shard``),
        q and k rotated at the tokens' ``rope_positions`` (Su et al. 2021), never at the
        chunk's local 0..n-1."""
        n, b, _ = qkv.shape
        d = self.cfg.head_dim
        q, k, v = qkv.split([self.heads * d, self.kv_heads * d, self.kv_heads * d], dim=-1)
        q, k, v = (t.reshape(n, b, -1, d).transpose(0, 1) for t in (q, k, v))
        theta = self.cfg.rope_theta
        if theta:
            pos = self.rope_positions(docs).to(qkv.device)
            q, k = (rotate(t.transpose(1, 2), pos, theta).transpose(1, 2) for t in (q, k))
        return q, k, v

    def token_mean(self, loss: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The counted tokens' mean loss (``MegatronGPT.token_mean``), or with
        ``summed_loss`` their sum (the scheme divides by the global count)."""
        if not self.summed_loss:
            return super().token_mean(loss, target)
        return loss.masked_fill(target == IGNORE_INDEX, 0.0).sum()

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
                              self.ep_group, self.ep, self.aux_scale,
                              expert_bias=self.balance.of(i))
        self.moe_stats[i] = stats
        self.balance.add(i, stats["load"])
        if i in self._shared:  # on the same tokens: its gradient is partial over tp too
            shared = self._shared[i]
            y = y + expert_mlp(tokens, shared.fc1, shared.fc2)
        y = y.view(xs.shape)
        if split:
            n = xs.shape[0]
            pad = (0, 0, 0, 0, self.rank * n, (self.tp - 1 - self.rank) * n)
            y = ReduceFromRegion.apply(F.pad(y, pad), self.group)
        return y
