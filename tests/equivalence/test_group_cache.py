"""Meshes of one rank process share their process groups by member list (issue 24): a
second mesh over a grid already seen creates no group, two axes of one mesh never share a
group (the ledger names the axis by group identity), and the shared groups carry
collectives, each charged to the axis the mesh that handed it out names."""
from __future__ import annotations

import torch
import torch.distributed as dist

from parbench import group_cache
from parbench.comm import Ledger
from parbench.layout import Layout
from parbench.mesh import Mesh

#: in a dp2 world these three kinds have the same members, [0, 1]
SAME_MEMBERS = ("dp", "dp_cp", "tp_dp_cp")


def _two_meshes(ctx):
    first = Mesh.build(Layout(dp=2), ctx.rank)
    Mesh.build(Layout(tp=2), ctx.rank)  # tp, tp_cp, mp, tp_dp_cp, etp over [0, 1]
    before = group_cache.created()
    other = Mesh.build(Layout(tp=2), ctx.rank)
    again = Mesh.build(Layout(dp=2), ctx.rank)
    distinct = len({id(first.group(a)) for a in SAME_MEMBERS})
    shared = all(again.group(a) is first.group(a) for a in SAME_MEMBERS)
    with Ledger(axis_of=other.axis_of_group) as led_tp:
        dist.all_reduce(torch.ones(4), group=other.group("tp"))
    with Ledger(axis_of=again.axis_of_group) as led_dp:
        dist.all_reduce(torch.ones(4), group=again.group("dp_cp"))
    return (group_cache.created() - before, distinct, shared,
            [r.axis for r in led_tp.records], [r.axis for r in led_dp.records])


def test_meshes_share_groups_by_members_and_keep_the_axes_apart(pools):
    for new, distinct, shared, tp_axes, dp_axes in pools(2).run(_two_meshes):
        assert new == 0  # the second dp2 and tp2 meshes reuse the first ones' groups
        assert distinct == len(SAME_MEMBERS)
        assert shared
        assert tp_axes == ["tp"] and dp_axes == ["dp_cp"]
