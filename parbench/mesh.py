"""The rank grid and its named process groups, laid out as Megatron-Core lays them out.

Megatron-Core enumerates ranks with tensor parallelism fastest and pipeline slowest, in the
order tp-cp-ep-dp-pp (``parallel_state.RankGenerator``). For the dense part of the model ep
is 1, so world = tp * cp * dp * pp. Expert parallelism does not add a factor to the world: the
tp * cp * dp ranks of each pipeline stage are re-partitioned as expert-tp x ep x expert-dp
(order tp-ep-dp-pp with expert-tp = tp here).

A group over a set of axes holds the ranks that share every *other* coordinate, listed with
the first named axis fastest (Megatron's ``generate_masked_orthogonal_rank_groups``).
Process groups are built once per mesh and handed to schemes explicitly.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from itertools import product


class Axis(str, Enum):
    """A named process group of the mesh. ``Axis("tpp")`` raises ``ValueError`` listing the
    valid names; members compare equal to their strings (``Axis.TP == "tp"``)."""

    TP = "tp"
    CP = "cp"
    DP = "dp"
    PP = "pp"
    EP = "ep"
    ETP = "etp"
    EDP = "edp"
    DP_CP = "dp_cp"
    TP_CP = "tp_cp"
    MP = "mp"
    TP_DP_CP = "tp_dp_cp"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def _missing_(cls, value):
        raise ValueError(f"axis {value!r} is not a mesh axis (choose from "
                         f"{', '.join(a.value for a in cls)})")


#: the degrees a case sets, in Megatron-Core's order
DEGREES = ("tp", "cp", "ep", "dp", "pp")
DENSE_ORDER = ("tp", "cp", "dp", "pp")
EXPERT_ORDER = ("etp", "ep", "edp", "pp")


def check_expert_layout(*, tp: int, cp: int, dp: int, ep: int, etp: int | None = None,
                        error=ValueError) -> None:
    """The one place the rule is stated: ep re-partitions the tp*cp*dp ranks of a stage as
    expert-tp x ep x expert-dp (expert-tp = tp unless given), so etp*ep must divide
    tp*cp*dp."""
    etp = tp if etp is None else etp
    if etp == tp and (cp * dp) % ep:
        raise error(f"ep={ep} does not divide cp*dp={cp * dp} "
                    "(expert parallelism re-partitions the tp*cp*dp ranks of a stage)")
    if (tp * cp * dp) % (etp * ep):
        raise error(f"etp*ep={etp}*{ep} does not divide tp*cp*dp={tp * cp * dp} "
                    "(expert parallelism re-partitions the tp*cp*dp ranks of a stage)")

#: Groups built for every mesh: name -> (order, axes). Names follow Megatron where it has one.
GROUP_SPECS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "tp": (DENSE_ORDER, ("tp",)),
    "cp": (DENSE_ORDER, ("cp",)),
    "dp": (DENSE_ORDER, ("dp",)),
    "pp": (DENSE_ORDER, ("pp",)),
    "dp_cp": (DENSE_ORDER, ("cp", "dp")),  # gradient reduction with context parallelism
    "tp_cp": (DENSE_ORDER, ("tp", "cp")),
    "mp": (DENSE_ORDER, ("tp", "pp")),  # model parallel
    "tp_dp_cp": (DENSE_ORDER, ("tp", "cp", "dp")),  # all ranks of one pipeline stage
    "ep": (EXPERT_ORDER, ("ep",)),
    "etp": (EXPERT_ORDER, ("etp",)),
    "edp": (EXPERT_ORDER, ("edp",)),
}


assert {a.value for a in Axis} == set(GROUP_SPECS), "Axis and GROUP_SPECS disagree"


@dataclass(frozen=True)
class MeshLayout:
    """Pure layout: which ranks form which group. No torch.distributed needed."""

    tp: int = 1
    cp: int = 1
    dp: int = 1
    pp: int = 1
    ep: int = 1
    #: expert tensor-parallel size; 0 = tp (Megatron-Core's default)
    etp: int = 0

    def __post_init__(self) -> None:
        for name in ("tp", "cp", "dp", "pp", "ep"):
            v = getattr(self, name)
            if v < 1:
                raise ValueError(f"{name}={v} must be >= 1")
        check_expert_layout(tp=self.tp, cp=self.cp, dp=self.dp, ep=self.ep, etp=self.expert_tp)

    @property
    def expert_tp(self) -> int:
        return self.etp or self.tp

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    def sizes(self, order: tuple[str, ...]) -> dict[str, int]:
        base = {"tp": self.tp, "cp": self.cp, "dp": self.dp, "pp": self.pp,
                "etp": self.expert_tp, "ep": self.ep,
                "edp": self.tp * self.cp * self.dp // (self.expert_tp * self.ep)}
        return {a: base[a] for a in order}

    def coords(self, rank: int, order: tuple[str, ...] = DENSE_ORDER) -> dict[str, int]:
        out, r = {}, rank
        for axis, size in self.sizes(order).items():
            out[axis] = r % size
            r //= size
        return out

    def rank_of(self, order: tuple[str, ...] = DENSE_ORDER, **coords: int) -> int:
        rank, stride = 0, 1
        for axis, size in self.sizes(order).items():
            rank += coords.get(axis, 0) * stride
            stride *= size
        return rank

    def groups(self, name: str) -> list[list[int]]:
        """Every group of the named kind, e.g. ``groups('tp')``."""
        order, axes = GROUP_SPECS[name]
        sizes = self.sizes(order)
        others = [a for a in order if a not in axes]
        out = []
        for fixed in product(*(range(sizes[a]) for a in reversed(others))):
            fixed_coords = dict(zip(reversed(others), fixed))
            members = []
            for inner in product(*(range(sizes[a]) for a in reversed(axes))):
                c = dict(fixed_coords)
                c.update(dict(zip(reversed(axes), inner)))
                members.append(self.rank_of(order, **c))
            out.append(members)
        # Megatron lists groups by their smallest rank
        return sorted(out, key=lambda g: g[0])

    def group_of(self, name: str, rank: int) -> list[int]:
        for g in self.groups(name):
            if rank in g:
                return g
        raise KeyError(f"rank {rank} is in no {name} group")

    def describe(self) -> dict:
        return {"world_size": self.world_size,
                "degrees": {"tp": self.tp, "cp": self.cp, "ep": self.ep, "dp": self.dp,
                            "pp": self.pp},
                "ranks": {r: self.coords(r) for r in range(self.world_size)},
                "groups": {n: self.groups(n) for n in GROUP_SPECS}}


@dataclass
class Mesh:
    """A layout plus this rank's process groups (``None`` outside torch.distributed)."""

    layout: MeshLayout
    rank: int
    _pgs: dict[str, object] = field(default_factory=dict)
    _ranks: dict[str, list[int]] = field(default_factory=dict)
    #: groups a scheme carves out of the mesh (``subgroup``): name -> (pg, ranks)
    _sub: dict[str, tuple[object, list[int]]] = field(default_factory=dict)
    _sub_parts: dict[str, list[list[int]]] = field(default_factory=dict)
    #: every partition created: (name, canonical partition) -> (pg, ranks)
    _sub_keys: dict[tuple, tuple[object, list[int]]] = field(default_factory=dict)

    @classmethod
    def build(cls, layout: MeshLayout, rank: int, backend_groups: bool = True) -> "Mesh":
        """Create every group of every kind (collectively: all ranks call in the same order)."""
        mesh = cls(layout=layout, rank=rank)
        for name in GROUP_SPECS:
            for members in layout.groups(name):
                pg = None
                if backend_groups:
                    import torch.distributed as dist
                    pg = dist.new_group(members)
                if rank in members:
                    mesh._pgs[name] = pg
                    mesh._ranks[name] = members
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
