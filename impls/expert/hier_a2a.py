"""Tutel's two-dimensional hierarchical (2DH) all-to-all (Hwang et al. 2023, "Tutel: Adaptive
Mixture-of-Experts at Scale", MLSys 2023, arXiv 2206.03382, Sec. "2DH All-to-All" and its
figure of the two phases): the same exchange as one flat all-to-all over the W = N L ranks
of the ep group (N "nodes" of L local ranks), done as an intra-node all-to-all followed by an
inter-node one, with a local re-layout before each phase, so that every inter-node message
is L times larger and a rank talks to L - 1 + N - 1 peers instead of W - 1.

Layout. The send buffer is cut along its first dimension into W equal chunks; chunk q goes
to ep rank q = b L + j (node b, local index j). Ranks are laid out node-major: the members
of an ep group are consecutive global ranks (``parbench.mesh``: ep fastest), and a node is
``RANKS_PER_NODE`` consecutive ranks (the placement ``torchrun`` gives on a real cluster).

1. re-layout ``[N(b), L(j), chunk]`` -> ``[L(j), N(b), chunk]`` (group by local destination);
2. intra-node all-to-all over the L ranks of the node: block j goes to local rank j, which
   receives ``[L(i: local source), N(b), chunk]``;
3. re-layout ``[L(i), N(b), chunk]`` -> ``[N(b), L(i), chunk]`` (group by destination node);
4. inter-node all-to-all over the N ranks with the same local index: block b goes to node b,
   which receives ``[N(a), L(i), chunk]`` -- source rank p = a L + i in order, exactly the
   flat all-to-all's output.

The exchange is a permutation whose adjoint is the same exchange (as for the flat all-to-all),
so the backward is the 2-D all-to-all of the gradients. Each phase moves the whole buffer S:
(L-1)/L S on the intra-node group and (N-1)/N S on the inter-node group; a phase over one
rank is skipped.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .dispatch import all_to_all

#: local ranks per "node" (the CPU runs have no real nodes: stated here, ep must be a
#: multiple of it for ``moe_a2a=2d``)
RANKS_PER_NODE = 2
#: the ledger axes of the two phases (``Mesh.subgroup`` names)
INTRA_AXIS, INTER_AXIS = "ep_intra", "ep_inter"


@dataclass
class TwoDimPlan:
    """This rank's two phase groups (None for a phase over one rank) and the grid N x L."""

    intra: object
    inter: object
    nodes: int
    local: int
    #: step 3, the re-layout between the phases (a variant replaces it: the self-test)
    between: Callable = None  # type: ignore[assignment]

    def __post_init__(self):
        if self.between is None:
            self.between = between_phases


def node_partitions(ep_groups: list[list[int]], local: int
                    ) -> tuple[list[list[int]], list[list[int]]]:
    """The intra-node and inter-node partitions of the world for ep groups ``ep_groups`` (each
    in ep order, consecutive ranks): intra = the L consecutive members of a node; inter = the
    members with the same local index, one per node."""
    intra, inter = [], []
    for g in ep_groups:
        if list(g) != sorted(g) or len(g) % local:
            raise ValueError(f"ep group {g} is not {local}-aligned consecutive ranks")
        nodes = len(g) // local
        intra += [list(g[b * local:(b + 1) * local]) for b in range(nodes)]
        inter += [[g[b * local + j] for b in range(nodes)] for j in range(local)]
    return intra, inter


def build_plan(mesh, ep: int, local: int = RANKS_PER_NODE) -> TwoDimPlan:
    """Create both partitions' groups on ``mesh`` (collective: every rank calls it)."""
    intra, inter = node_partitions(mesh.layout.groups("ep"), local)
    nodes = ep // local
    g_intra = mesh.subgroup(INTRA_AXIS, intra)
    g_inter = mesh.subgroup(INTER_AXIS, inter)
    return TwoDimPlan(g_intra if local > 1 else None, g_inter if nodes > 1 else None,
                      nodes, local)


def relayout(x: torch.Tensor, first: int, second: int) -> torch.Tensor:
    """``[first, second, rest]`` -> ``[second, first, rest]`` (a strided local copy)."""
    return x.reshape(first, second, -1).transpose(0, 1).contiguous()


def two_dim_all_to_all(x: torch.Tensor, plan: TwoDimPlan) -> torch.Tensor:
    """The flat all-to-all's result on ``x`` (cut along dim 0 into N L chunks) in two phases
    (module docstring)."""
    n, loc = plan.nodes, plan.local
    y = relayout(x, n, loc)  # [L(j), N(b), chunk]
    if plan.intra is not None:
        y = all_to_all(y, plan.intra)  # [L(i), N(b), chunk]
    y = plan.between(y, loc, n)  # [N(b), L(i), chunk]
    if plan.inter is not None:
        y = all_to_all(y, plan.inter)  # [N(a), L(i), chunk]
    return y.reshape(x.shape)


def between_phases(y: torch.Tensor, local: int, nodes: int) -> torch.Tensor:
    """Step 3: ``[L(i), N(b), chunk]`` -> ``[N(b), L(i), chunk]``."""
    return relayout(y, local, nodes)


class TwoDimAllToAll(torch.autograd.Function):
    """2-D all-to-all forward; the same exchange of the gradients backward."""

    @staticmethod
    def forward(ctx, x, plan):
        ctx.plan = plan
        return two_dim_all_to_all(x, plan)

    @staticmethod
    def backward(ctx, grad):
        return two_dim_all_to_all(grad, ctx.plan), None
