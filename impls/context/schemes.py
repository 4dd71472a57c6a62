"""The native context-parallel schemes (see ``base`` and the module of each core)."""
from __future__ import annotations

from parbench.analytic import context as closed
from parbench.analytic.shape import shape_from
from parbench.config import CaseConfig, ConfigError
from parbench.scheme import register

from .allgather import AllGatherCore, GatherGroup
from .base import ContextParallelScheme
from .layout import positions, usp_positions
from .rsa import RSACore
from .ulysses import UlyssesRingCore


@register
class RingSelfAttentionScheme(ContextParallelScheme):
    """Li et al. 2021: K, then V around the ring; full score rows per rank (every query
    head's against its K/V head under grouped-query attention, ``rsa``)."""

    name = "context.ring-self-attention"
    kind = "ring-self-attention"
    description = "Ring Self-Attention (Li et al. 2021): K then V around the ring"
    #: the score rows masked "causal and same document" (``rsa``)
    supports_packing = True

    core_class = RSACore

    def build_core(self):
        ring = self.peers_class(self.ctx.mesh.group("cp") if self.cp > 1 else None, self.clock)
        return self.core_class(ring)

    def token_positions(self):
        return positions(self.ctx.model.seq_length, self.cp, self.cp_rank)


@register
class RingAttentionScheme(ContextParallelScheme):
    """Liu et al. 2023: blockwise causal attention, K/V blocks around the ring."""

    name = "context.ring-attention"
    kind = "ring-attention"
    balanced = True
    options = ("cp_balance", "recompute")
    description = "Ring Attention (Liu et al. 2023), causal, zigzag / striped / no balancing"
    #: every (query block, K/V block) pair masked by the documents' ids (``ring``)
    supports_packing = True
    core_class = UlyssesRingCore

    def build_core(self):
        ring = self.peers_class(self.ctx.mesh.group("cp") if self.cp > 1 else None,
                                self.clock, self.balance(self.ctx.case))
        return self.core_class(None, 1, ring)

    def token_positions(self):
        return positions(self.ctx.model.seq_length, self.cp, self.cp_rank,
                         self.balance(self.ctx.case))

    @classmethod
    def predicted_work(cls, case: CaseConfig):
        return closed.causal_block_work(case.model.seq_length, case.layout.cp,
                                        case.options.context.cp_balance)


@register
class UlyssesScheme(ContextParallelScheme):
    """Jacobs et al. 2023: all-to-all sequence -> heads, local attention, and back."""

    name = "context.ulysses"
    kind = "ulysses"
    description = "DeepSpeed-Ulysses (Jacobs et al. 2023): all-to-all sequence <-> heads"
    #: the whole sequence per head after the all-to-all: the documents' mask as is
    supports_packing = True
    core_class = UlyssesRingCore

    @classmethod
    def check(cls, case: CaseConfig) -> None:
        super().check(case)
        p, m = case.layout, case.model
        if m.num_heads % p.cp:
            raise ConfigError(f"cp={p.cp} does not divide num_heads={m.num_heads} "
                              "(Ulysses shards the heads over the cp ranks)")
        kv = m.num_kv_heads or m.num_heads
        if kv % p.cp:
            raise ConfigError(f"cp={p.cp} does not divide num_kv_heads={kv} (Ulysses shards "
                              "the K/V heads over the cp ranks with their query groups)")

    def build_core(self):
        group = self.ctx.mesh.group("cp") if self.cp > 1 else None
        return self.core_class(group, self.cp, self.peers_class(None, self.clock))

    def token_positions(self):
        return positions(self.ctx.model.seq_length, self.cp, self.cp_rank)

    @classmethod
    def predicted_work(cls, case: CaseConfig):
        s, cp = case.model.seq_length, case.layout.cp
        return [s * (s + 1) // 2 // cp] * cp  # heads/cp each, the whole causal sequence

    @classmethod
    def predict(cls, case: CaseConfig):
        out = super().predict(case)
        p, m = case.layout, case.model
        out.figures["issue_4217"] = closed.ulysses_vs_megatron_sp(
            p.micro_batch_size, m.seq_length, m.hidden_size, p.cp,
            h_kv=shape_from(m).kv_hidden)
        return out

    def metrics(self):
        out = super().metrics()
        fig = self.predict(self.ctx.case).figures["issue_4217"]
        measured = self._fwd_cp_bytes
        per_layer = None if measured is None else measured / self.ctx.model.num_layers
        # DeepSpeed issue 4217: this rank's forward bytes per layer, measured by the ledger,
        # beside Megatron-SP's closed form for the same b, s, h and degree
        out["ulysses_fwd_bytes_per_layer"] = per_layer
        out["ulysses_fwd_bytes_per_layer_predicted"] = fig["ulysses_fwd_bytes_per_layer"]
        out["megatron_sp_fwd_bytes_per_layer_formula"] = fig["megatron_sp_fwd_bytes_per_layer"]
        out["megatron_sp_over_ulysses"] = (fig["megatron_sp_fwd_bytes_per_layer"] / per_layer
                                           if per_layer else None)
        return out


class UlyssesRingGrid:
    """Mixin for schemes on a 2-D cp grid: ``cp_ulysses`` ranks share out the heads, rings of
    ``cp / cp_ulysses`` ranks pass K and V (USP, LoongTrain); put it before
    ``ContextParallelScheme``."""

    #: what shards the heads, for the error message
    head_sharder = "Ulysses"

    @classmethod
    def check(cls, case: CaseConfig) -> None:
        m, u = case.model, case.options.context.cp_ulysses
        if m.num_heads % u:
            raise ConfigError(f"cp_ulysses={u} does not divide num_heads={m.num_heads} "
                              f"({cls.head_sharder} shards the heads)")
        if m.num_kv_heads and m.num_kv_heads % u:
            raise ConfigError(f"cp_ulysses={u} does not divide num_kv_heads={m.num_kv_heads} "
                              f"({cls.head_sharder} shards the K/V heads with their query "
                              "groups)")
        super().check(case)

    @classmethod
    def ring_size(cls, case) -> int:
        return case.layout.cp // case.options.context.cp_ulysses

    @classmethod
    def cp_ulysses(cls, case) -> int:
        return case.options.context.cp_ulysses


@register
class USPScheme(UlyssesRingGrid, ContextParallelScheme):
    """Fang & Zhao 2024: Ulysses (cp_ulysses ranks) x ring attention (cp / cp_ulysses)."""

    name = "context.usp"
    kind = "usp"
    balanced = True
    options = ("cp_balance", "cp_ulysses", "recompute")
    description = "USP (Fang & Zhao 2024): Ulysses x ring attention on a 2-D cp grid"
    #: the Ulysses gather of the ring rank's tokens, then the ring's document masks
    supports_packing = True
    core_class = UlyssesRingCore

    @classmethod
    def check(cls, case: CaseConfig) -> None:
        u = case.options.context.cp_ulysses
        if case.layout.cp % u:
            raise ConfigError(f"cp_ulysses={u} does not divide cp={case.layout.cp}")
        super().check(case)  # the heads (UlyssesRingGrid), then the rest

    def _grid(self):
        u = self.ctx.options.context.cp_ulysses
        return u, self.cp // u, self.cp_rank % u, self.cp_rank // u

    @staticmethod
    def grid_partition(cp_groups: list[list[int]], u: int):
        """(Ulysses groups, ring groups) of the cp groups: u consecutive members of a cp
        group, and its members of stride u (Fang & Zhao 2024, Sec. 3: Ulysses inside, ring
        across)."""
        r = len(cp_groups[0]) // u
        return ([g[i * u:(i + 1) * u] for g in cp_groups for i in range(r)],
                [g[j::u] for g in cp_groups for j in range(u)])

    def grid_groups(self):
        """This rank's Ulysses group and ring group (``grid_partition``), as mesh subgroups
        on the axes ``cp_ulysses`` and ``cp_ring``."""
        mesh = self.ctx.mesh
        uly, ring = self.grid_partition(mesh.layout.groups("cp"), self._grid()[0])
        return mesh.subgroup(closed.ULYSSES_AXIS, uly), mesh.subgroup(closed.RING_AXIS, ring)

    def build_core(self):
        u, r, _, _ = self._grid()
        uly, ring = self.grid_groups()
        peers = self.peers_class(ring if r > 1 else None, self.clock,
                                 self.balance(self.ctx.case))
        return self.core_class(uly if u > 1 else None, u, peers)

    def token_positions(self):
        u, r, ui, ri = self._grid()
        return usp_positions(self.ctx.model.seq_length, u, r, ui, ri,
                             self.balance(self.ctx.case))

    @classmethod
    def predicted_work(cls, case: CaseConfig):
        p = case.layout
        u, r = case.options.context.cp_ulysses, p.cp // case.options.context.cp_ulysses
        ring = closed.causal_block_work(case.model.seq_length, r, case.options.context.cp_balance)
        return [w // u for w in ring for _ in range(u)]  # heads/u of the ring rank's work


@register
class AllGatherScheme(ContextParallelScheme):
    """Llama 3: K and V all-gathered along the sequence, local queries, masked."""

    name = "context.allgather"
    gather_class = GatherGroup
    kind = "allgather"
    balanced = True
    options = ("cp_balance", "recompute")
    description = "all-gather CP (Llama 3): K, V gathered along the sequence"
    #: every query sees the whole gathered sequence in one kernel, so a packed document's
    #: mask is the gathered ids' (``GatherGroup.mask``)
    supports_packing = True

    def bind_documents(self, docs):
        self.core.g.docs = docs

    def build_core(self):
        every = [positions(self.ctx.model.seq_length, self.cp, r, self.balance(self.ctx.case))
                 for r in range(self.cp)]
        return AllGatherCore(self.gather_class(self.ctx.mesh.group("cp"), every, self.clock))

    def token_positions(self):
        return positions(self.ctx.model.seq_length, self.cp, self.cp_rank,
                         self.balance(self.ctx.case))
