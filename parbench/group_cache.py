"""Process groups shared by every mesh of a rank process, keyed on (backend, members).

Every ``torch.distributed.new_group`` starts a backend of its own (for gloo: its worker
threads and its store connections, torch's ``ProcessGroupGloo``), and nothing gives them
back before the process group is destroyed. A rank of the session pool runs hundreds of
cases over tens of layouts; creating the groups of every kind afresh for each layout left
about 600 gloo threads per rank late in a test session (issue 24). Groups are therefore
created once per member list and backend and handed to every mesh that needs that member list.

One constraint is kept from the ledger: it tells the axes apart by the identity of the
group a collective was given (``Mesh.axis_of_group``), so within one mesh two axes never
share a group object. A member list needed by several axes of one mesh (in a ``dp2`` world
``dp``, ``dp_cp`` and ``tp_dp_cp`` are all ``[0, 1]``) takes as many groups; later meshes
reuse them. The number of groups per member list is thus the largest number of axes one
mesh names over it, however many meshes the process builds.

``new_group`` is collective: every rank of the world calls it, in the same order, member of
the group or not (torch.distributed's documentation of ``new_group``). The cache keeps that:
its state -- how many groups exist per member list -- is changed only by ``take``, which every
rank calls with the same arguments in the same order (it counts groups a rank is not a member
of too), so every rank decides to create a group, or not, at the same call.
"""
from __future__ import annotations

#: (backend, members) -> groups created for that member list, in creation order
_GROUPS: dict[tuple, list] = {}
#: the default group the cached groups belong to (a new world invalidates them)
_WORLD: list = [None]


def _groups_of(members: tuple[int, ...]) -> list:
    import torch.distributed as dist
    world = dist.group.WORLD
    if _WORLD[0] is not world:
        _GROUPS.clear()
        _WORLD[0] = world
    return _GROUPS.setdefault((dist.get_backend(), members), [])


def take(members: list[int], busy: set[int]) -> tuple[int, object]:
    """The first group over ``members`` whose index is not in ``busy`` (the indices the
    calling mesh already gave other axes), created if every existing one is busy. Returns
    (index, group); the group is torch's non-member marker on a rank outside ``members``.
    Collective: every rank calls it with the same arguments in the same order."""
    import torch.distributed as dist
    groups = _groups_of(tuple(sorted(members)))
    index = next((i for i in range(len(groups)) if i not in busy), len(groups))
    if index == len(groups):
        groups.append(dist.new_group(sorted(members)))
    return index, groups[index]


def created() -> int:
    """How many groups this process has created through the cache (for tests)."""
    return sum(len(g) for g in _GROUPS.values())
