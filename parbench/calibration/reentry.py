"""What a split backward's W costs the autograd engine on this machine, beyond its weight
gradients (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", Sec. 2 splits the backward
into B and W; on an eager framework W re-enters the graph kept by B):

- :func:`reentry_costs`: one ``torch.autograd.grad`` call that re-enters a kept graph at a
  node (``GradientEdge``) for one weight -- its fixed cost -- and what every node below the
  entry adds (the engine walks the graph under its roots to find what to run): the
  intercept and the slope of that call's time over the length of a chain below it;
- :func:`graph_counts`: a layer's autograd graph -- its nodes, and its *weight nodes*, the
  nodes a W re-enters (a node on the path from the output to the layer's input with a child
  that leads to parameters only: a linear's matmul, a norm).

The engine's walk is PyTorch's; the layer is the calibrated local layer, whose operators are
the reference model's (``tests/unit/test_calibration_local_model.py``)."""
from __future__ import annotations

from typing import Callable

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

#: the chain lengths below the entry node the slope is taken between
CHAIN = (1, 129)


def reentry_costs(dev: str, timer: Callable[[Callable[[], object]], float]
                  ) -> dict[str, float]:
    """``grad_reentry_s`` (a re-entering ``autograd.grad`` call for one weight, the node's
    own work excluded as far as a 4-element multiply is) and ``graph_walk_s`` (seconds per
    node below the entry); ``timer(fn)``: seconds per call of ``fn``."""
    w = torch.ones(4, device=dev, requires_grad=True)
    g = torch.ones(4, device=dev)
    times = []
    for k in CHAIN:
        y = torch.ones(4, device=dev, requires_grad=True)
        for _ in range(k):
            y = y * 1.0001
        node = (y * w).grad_fn

        def call(node=node):
            torch.autograd.grad([GradientEdge(node, 0)], [w], [g], retain_graph=True,
                                allow_unused=True)
        times.append(timer(call))
    walk = max((times[1] - times[0]) / (CHAIN[1] - CHAIN[0]), 0.0)
    return {"grad_reentry_s": max(times[0] - CHAIN[0] * walk, 0.0), "graph_walk_s": walk}


def _reaches(node, target, memo: dict) -> bool:
    """Whether ``node`` leads to ``target`` (iterative, memoised)."""
    stack = [node]
    while stack:
        n = stack[-1]
        if n in memo:
            stack.pop()
            continue
        kids = [c for c, _ in n.next_functions if c is not None]
        todo = [c for c in kids if c not in memo]
        if n is target:
            memo[n] = True
        elif todo:
            stack.extend(todo)
            continue
        else:
            memo[n] = any(memo[c] for c in kids)
        stack.pop()
    return memo[node]


def graph_counts(layer: torch.nn.Module, x: torch.Tensor) -> dict[str, int]:
    """``graph_nodes`` (every node under the layer's output, the input's own excluded) and
    ``weight_nodes`` (those on the input path with a child that leads to parameters only)."""
    x = x.detach().requires_grad_(True)
    out = layer(x)
    target = get_gradient_edge(x).node  # the input's AccumulateGrad node
    memo: dict = {}
    _reaches(out.grad_fn, target, memo)
    nodes = [n for n in memo if n is not target]
    weight = sum(1 for n in nodes if memo[n] and any(
        c is not None and not memo.get(c, False) for c, _ in n.next_functions))
    return {"graph_nodes": len(nodes), "weight_nodes": weight}
