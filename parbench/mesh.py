"""This rank's process groups over the rank grid of a :class:`~parbench.layout.Layout`.

The grid itself -- which ranks form which group, in Megatron-Core's order -- is pure and lives
in :mod:`parbench.layout`; a ``Mesh`` takes the torch.distributed groups of that grid once
(from :mod:`parbench.group_cache`, shared by member list with the process's other meshes)
and hands them to schemes explicitly (no global parallel state).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from . import group_cache
from .layout import GROUP_SPECS, Axis, Layout


@dataclass
class Mesh:
    """A layout plus this rank's process groups (``None`` outside torch.distributed).

    The groups come from :mod:`parbench.group_cache`: shared with the other meshes of this
    process by member list, never between two names of this mesh (the ledger tells axes apart
    by group identity, ``axis_of_group``)."""

    layout: Layout
    rank: int
    _pgs: dict[str, object] = field(default_factory=dict)
    _ranks: dict[str, list[int]] = field(default_factory=dict)
    #: groups a scheme carves out of the mesh (``subgroup``): name -> (pg, ranks)
    _sub: dict[str, tuple[object, list[int]]] = field(default_factory=dict)
    _sub_parts: dict[str, list[list[int]]] = field(default_factory=dict)
    #: member list -> {axis or subgroup name -> (index in the shared cache, pg)}
    _slots: dict[tuple[int, ...], dict[str, tuple[int, object]]] = field(default_factory=dict)
    #: this rank's groups and the name each carries: (pg, name)
    _names: list[tuple[object, str]] = field(default_factory=list)
    #: id(pg) -> (pg, its name): ``axis_of_group`` on every recorded call; emptied when a
    #: group is named
    _axis_cache: dict[int, tuple[object, str | None]] = field(default_factory=dict)

    @classmethod
    def build(cls, layout: Layout, rank: int, backend_groups: bool = True) -> "Mesh":
        """Every group of every kind (collectively: all ranks call in the same order)."""
        mesh = cls(layout=layout, rank=rank)
        for name in GROUP_SPECS:
            for members in layout.groups(name):
                pg = mesh._group(name.value, members) if backend_groups else None
                if rank in members:
                    mesh._pgs[name.value] = pg
                    mesh._ranks[name.value] = members
        return mesh

    def _group(self, name: str, members: list[int]):
        """The group of ``members`` that carries ``name`` in this mesh (collective)."""
        slots = self._slots.setdefault(tuple(sorted(members)), {})
        if name not in slots:
            slots[name] = group_cache.take(members, {i for i, _ in slots.values()})
            if self.rank in members:
                self._names.append((slots[name][1], name))
                self._axis_cache.clear()
        return slots[name][1]

    def group(self, axis: Axis | str):
        """This rank's process group for an axis (a typo raises, listing the valid axes)."""
        return self._pgs[Axis(axis).value]

    def ranks(self, axis: Axis | str) -> list[int]:
        return self._ranks[Axis(axis).value]

    def size(self, axis: Axis | str) -> int:
        return len(self.ranks(axis))

    def index(self, axis: Axis | str) -> int:
        """This rank's position inside its group of that axis."""
        return self.ranks(axis).index(self.rank)

    def subgroup(self, name: str, partition: list[list[int]]):
        """This rank's group of ``partition`` (lists of global ranks that together cover the
        world), taken once per mesh, name and member list from the process's shared groups
        -- collectively: every rank calls it with the same arguments in the same order -- and
        known to the ledger as axis
        ``name`` (e.g. the row and column groups of 2-D tensor parallelism inside Megatron's
        tp groups). One name may carry several partitions (grids of different shapes on the
        same ranks, one case after another); each is recorded as axis ``name``. Returns None
        on a rank that no part holds."""
        mine = (None, [])
        for members in partition:
            pg = self._group(name, members)
            if self.rank in members:
                mine = (pg, sorted(members))
        self._sub[name] = mine
        self._sub_parts[name] = [list(m) for m in partition]
        return mine[0]

    def subgroup_ranks(self, name: str) -> list[int]:
        """The ranks of this rank's group of the partition last requested under ``name``."""
        return self._sub[name][1]

    def axis_of_group(self, pg) -> str | None:
        """The axis or subgroup name ``pg`` carries in this mesh (None: not one of its)."""
        if pg is None:
            return None
        key = id(pg)
        hit = self._axis_cache.get(key)
        if hit is None or hit[0] is not pg:  # by identity (an id can be reused)
            hit = self._axis_cache[key] = (pg, next((name for g, name in self._names
                                                     if g is pg), None))
        return hit[1]

    @property
    def coords(self) -> dict[str, int]:
        return self.layout.coords(self.rank)
