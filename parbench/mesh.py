"""This rank's process groups over the rank grid of a :class:`~parbench.layout.Layout`.

The grid itself -- which ranks form which group, in Megatron-Core's order -- is pure and lives
in :mod:`parbench.layout`; a ``Mesh`` creates the torch.distributed groups of that grid once
and hands them to schemes explicitly (no global parallel state).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .layout import GROUP_SPECS, Axis, Layout


@dataclass
class Mesh:
    """A layout plus this rank's process groups (``None`` outside torch.distributed)."""

    layout: Layout
    rank: int
    _pgs: dict[str, object] = field(default_factory=dict)
    _ranks: dict[str, list[int]] = field(default_factory=dict)
    #: groups a scheme carves out of the mesh (``subgroup``): name -> (pg, ranks)
    _sub: dict[str, tuple[object, list[int]]] = field(default_factory=dict)
    _sub_parts: dict[str, list[list[int]]] = field(default_factory=dict)
    #: every partition created: (name, canonical partition) -> (pg, ranks)
    _sub_keys: dict[tuple, tuple[object, list[int]]] = field(default_factory=dict)

    @classmethod
    def build(cls, layout: Layout, rank: int, backend_groups: bool = True) -> "Mesh":
        """Create every group of every kind (collectively: all ranks call in the same order)."""
        mesh = cls(layout=layout, rank=rank)
        for name in GROUP_SPECS:
            for members in layout.groups(name):
                pg = None
                if backend_groups:
                    import torch.distributed as dist
                    pg = dist.new_group(members)
                if rank in members:
                    mesh._pgs[name.value] = pg
                    mesh._ranks[name.value] = members
        return mesh

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
        world), created once per mesh, name and partition -- collectively: every rank calls
        it with the same arguments in the same order -- and known to the ledger as axis
        ``name`` (e.g. the row and column groups of 2-D tensor parallelism inside Megatron's
        tp groups). One name may carry several partitions (grids of different shapes on the
        same ranks, one case after another); each is recorded as axis ``name``. Returns None
        on a rank that no part holds."""
        key = (name, tuple(sorted(tuple(sorted(m)) for m in partition)))
        if key not in self._sub_keys:
            import torch.distributed as dist
            mine = (None, [])
            for members in partition:
                pg = dist.new_group(sorted(members))
                if self.rank in members:
                    mine = (pg, sorted(members))
            self._sub_keys[key] = mine
        self._sub[name] = self._sub_keys[key]
        self._sub_parts[name] = [list(m) for m in partition]
        return self._sub[name][0]

    def subgroup_ranks(self, name: str) -> list[int]:
        """The ranks of this rank's group of the partition last requested under ``name``."""
        return self._sub[name][1]

    def axis_of_group(self, pg) -> str | None:
        for name, g in self._pgs.items():
            if g is pg:
                return name
        for (name, _), (g, _) in self._sub_keys.items():
            if g is pg and g is not None:
                return name
        return None

    @property
    def coords(self) -> dict[str, int]:
        return self.layout.coords(self.rank)
