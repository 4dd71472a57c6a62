"""LoongTrain (Gu et al. 2024, "LoongTrain: Efficient Training of Long-Sequence LLMs with
Head-Context Parallelism", arXiv 2406.18485, Sec. 4): 2D-Attention with Double-Ring-Attention.

The cp ranks of a group form a u x c grid, u = ``cp_ulysses`` (head parallel: Ulysses
all-to-alls inside a head group) by c = cp/u (context parallel); the context ring is cut into
c/w inner rings of w = ``cp_window`` ranks joined by an outer ring (``double_ring``). Tokens are
laid out as USP lays them (``layout.usp_positions``): the context rank's tokens under
``cp_balance`` (zig-zag by default, as LoongTrain's ring), cut into u contiguous pieces, so the
head group's all-to-all gathers its context rank's tokens in order.

Device placement (Sec. 4, compared in the paper; no config field, one scheme each):

- ``context.loongtrain``: **head-first** -- a head group is u consecutive cp ranks, a context
  ring takes every u-th (the all-to-all on the closest links; this is also USP's layout here,
  so the two compare group for group);
- ``context.loongtrain-cf``: **context-first** -- a context ring is c consecutive cp ranks, a
  window w consecutive ones (the inner ring on the closest links), a head group every c-th.

The ledger knows the groups as ``cp_ulysses`` (head), ``cp_inner`` and ``cp_outer``; bytes and
calls per group are placement-independent (``analytic.context_loongtrain``).

Model: the LLaMA blocks (RoPE at the tokens' global positions, SwiGLU, RMSNorm, no biases)
and grouped-query attention (Ainslie et al. 2023): the head all-to-all deals the query heads
and the num_kv_heads K/V heads to the head group in contiguous blocks (``ulysses.seq_to_heads``
on each), so a rank's a/u query heads are exactly the query groups of its g/u K/V heads (u
must divide g, Ulysses' rule; refused otherwise), and the double ring passes K/V blocks of
those g/u heads; the block kernels serve each K/V head's query group (``kernels``).
"""
from __future__ import annotations

from parbench.analytic import context as closed
from parbench.analytic import context_loongtrain as loong
from parbench.analytic import shape_from
from parbench.config import CaseConfig, ConfigError
from parbench.scheme import Prediction, register

from .base import ContextParallelScheme
from .double_ring import DoubleRingAttention, DoubleRingPeers
from .layout import usp_positions
from .schemes import UlyssesRingGrid
from .ulysses import UlyssesRingCore


class LoongTrainCore(UlyssesRingCore):
    """Ulysses over the head group, then Double-Ring-Attention over the context ring."""

    attention = DoubleRingAttention


def grid_groups(cp_groups: list[list[int]], u: int, w: int, head_first: bool
                ) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """(head groups, inner rings, outer rings) as lists of global ranks, each in its group's
    rank order, for every cp group. Head-first: cp index i = head index + u * context index;
    context-first: i = context index + c * head index."""
    heads, inner, outer = [], [], []
    for g in cp_groups:
        c = len(g) // u
        if head_first:
            rings = [g[j::u] for j in range(u)]
            heads += [g[i * u:(i + 1) * u] for i in range(c)]
        else:
            rings = [g[i * c:(i + 1) * c] for i in range(u)]
            heads += [g[j::c] for j in range(c)]
        for ring in rings:
            inner += [ring[a * w:(a + 1) * w] for a in range(c // w)]
            outer += [ring[j::w] for j in range(w)]
    return heads, inner, outer


@register
class LoongTrainScheme(UlyssesRingGrid, ContextParallelScheme):
    """Gu et al. 2024: head-parallel x context-parallel, double ring, head-first placement."""

    name = "context.loongtrain"
    kind = "loongtrain"
    balanced = True
    head_first = True
    options = ("cp_balance", "cp_ulysses", "cp_window", "recompute")
    description = ("LoongTrain (Gu et al. 2024): 2D-Attention (Ulysses heads x double-ring "
                   "context), head-first placement")
    core_class = LoongTrainCore
    head_sharder = "the head group"
    #: the double ring masks every block by the documents' ids (``double_ring``)
    supports_packing = True

    @classmethod
    def check(cls, case: CaseConfig) -> None:
        p = case.layout
        try:
            loong.check_grid(p.cp, case.options.context.cp_ulysses, case.options.context.cp_window)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        super().check(case)  # the heads (UlyssesRingGrid), then the rest

    def _coords(self):
        """(u, c, head index, context index) of this rank."""
        u = self.ctx.options.context.cp_ulysses
        c = self.cp // u
        if self.head_first:
            return u, c, self.cp_rank % u, self.cp_rank // u
        return u, c, self.cp_rank // c, self.cp_rank % c

    def build_core(self):
        mesh = self.ctx.mesh
        u, c, _, _ = self._coords()
        w = self.ctx.options.context.cp_window
        heads, inner, outer = grid_groups(mesh.layout.groups("cp"), u, w, self.head_first)
        head = mesh.subgroup(loong.HEAD_AXIS, heads) if u > 1 else None
        ring_in = mesh.subgroup(loong.INNER_AXIS, inner) if w > 1 else None
        ring_out = mesh.subgroup(loong.OUTER_AXIS, outer) if c // w > 1 else None
        peers = self.make_peers(ring_in, ring_out)
        return self.core_class(head, u, peers)

    def make_peers(self, ring_in, ring_out) -> DoubleRingPeers:
        balance = self.balance(self.ctx.case)
        return DoubleRingPeers(self.peers_class(ring_in, self.clock),
                               self.peers_class(ring_out, self.clock), self.clock, balance)

    def token_positions(self):
        u, c, hi, ci = self._coords()
        return usp_positions(self.ctx.model.seq_length, u, c, hi, ci,
                             self.balance(self.ctx.case))

    # ---- closed forms -------------------------------------------------------------------------
    @classmethod
    def predict(cls, case: CaseConfig) -> Prediction:
        p, mdl = case.layout, case.model
        pred = loong.loongtrain_prediction(
            shape_from(mdl), cp=p.cp, dp=p.dp, cp_ulysses=case.options.context.cp_ulysses,
            cp_window=case.options.context.cp_window, micro_batch_size=p.micro_batch_size,
            num_microbatches=p.num_microbatches, recompute=case.options.recompute,
            optimizer=case.run.optimizer)
        figures = dict(pred.figures)
        figures["activation_bytes_per_layer"] = closed.cp_layer_activation_bytes(
            cls.kind, mdl.seq_length, p.micro_batch_size, mdl.hidden_size, mdl.num_heads,
            p.cp, case.options.recompute, mdl.ffn, kv_hidden=shape_from(mdl).kv_hidden,
            blocks=closed.cp_block_keywords(mdl, mdl.seq_length // p.cp, p.micro_batch_size))
        figures["attention_work_per_rank"] = cls.predicted_work(case)
        figures["attention_imbalance"] = closed.imbalance(figures["attention_work_per_rank"])
        figures["versus_usp"] = cls.versus_usp(case)
        return Prediction.uniform(p.world_size, pred.wire_bytes, pred.states, pred.calls,
                                  **figures)

    @classmethod
    def versus_usp(cls, case: CaseConfig) -> dict:
        p, m, o = case.layout, case.model, case.options
        return loong.versus_usp(p.micro_batch_size, m.seq_length, m.hidden_size, p.cp,
                                o.context.cp_ulysses, o.context.cp_window, m.num_layers,
                                p.num_microbatches, 4, o.recompute != "none",
                                h_kv=shape_from(m).kv_hidden)

    @classmethod
    def predicted_work(cls, case: CaseConfig):
        """As USP's: the double ring visits every block of the context ring once."""
        p = case.layout
        u, c = case.options.context.cp_ulysses, p.cp // case.options.context.cp_ulysses
        ring = closed.causal_block_work(case.model.seq_length, c, case.options.context.cp_balance)
        if cls.head_first:
            return [wk // u for wk in ring for _ in range(u)]
        return [wk // u for _ in range(u) for wk in ring]

    # ---- the row ------------------------------------------------------------------------------
    def metrics(self) -> dict:
        out = super().metrics()
        v = self.predict(self.ctx.case).figures["versus_usp"]
        out["loongtrain_bytes_head_inner_outer"] = (
            f"{v['head_bytes']:.0f} / {v['inner_bytes']:.0f} / {v['outer_bytes']:.0f}")
        out["usp_bytes_ulysses_ring_same_grid"] = (
            f"{v['usp_ulysses_bytes']:.0f} / {v['usp_ring_bytes']:.0f}")
        out["same_total_as_usp"] = v["same_total_as_usp"]
        out["outer_hop_share"] = v["outer_hop_share"]
        out["inner_steps_hiding_outer_hop"] = v["steps_hiding_outer_hop"]
        return out


@register
class LoongTrainContextFirstScheme(LoongTrainScheme):
    """The same, context-first placement: a context ring on consecutive cp ranks."""

    name = "context.loongtrain-cf"
    head_first = False
    description = ("LoongTrain (Gu et al. 2024): 2D-Attention (Ulysses heads x double-ring "
                   "context), context-first placement")
