"""What a split backward's W costs the autograd engine, beyond its weight gradients, where
the host's time is the step's (a calibrated CPU profile; the GPU presets price none of it).

Zero Bubble (Qi et al. 2024, Sec. 2) splits a stage's backward into B (input gradient) and
W (weight gradients). An eager framework runs W by re-entering the graph B kept, once per
*weight node* (a linear's matmul, a norm: ``impls/pipeline/split_backward.py``;
torch.distributed.pipelining does the same per parameter group), and each re-entry's engine
first walks every node below its entry. So W on a stage of L layers of n graph nodes, w of
them weight nodes, with the LM head's 2 weight nodes (final norm, output linear) on the last
stage, costs

    (w L + 2) x grad_reentry_s + n (w L^2 / 2 + 2 L) x graph_walk_s

(the entries of layer i walk the i - 1 layers below them and on average half of their own:
w n (i - 1/2) summed over i = w n L^2 / 2). ``grad_reentry_s``, ``graph_walk_s`` and the
layer's n and w are what ``parbench calibrate`` measured (``calibration.reentry``). The first
stage has no input gradient to give: its W is its whole backward in one pass, no re-entry.
A profile without those measurements prices one ``backward()`` call per linear (4 a layer,
1 for the head), as before they existed.
"""
from __future__ import annotations

from .costs import _gated
from .profile import Profile

#: the LM head's weight nodes: the final norm and the output linear
HEAD_WEIGHT_NODES = 2


def layer_graph(profile: Profile, shape, tp: int) -> tuple[int, int] | None:
    """(graph nodes, weight nodes) of one layer at tensor-parallel degree ``tp``, as
    calibrate counted them for this model's layer (None: not counted)."""
    for p in profile.parts:
        if (p.get("kind") == "layer" and "graph_nodes" in p and p["h"] == shape.h
                and p["heads"] == shape.a // tp and p["f"] == shape.f // tp
                and bool(p.get("gated")) == _gated(shape)):
            return int(p["graph_nodes"]), int(p["weight_nodes"])
    return None


def w_reentry_s(profile: Profile, shape, tp: int, layers: int, first: bool, last: bool
                ) -> float:
    """The engine's seconds of one micro-batch's W on a stage of ``layers`` layers (module
    doc); ``first`` / ``last``: the pipeline's first / last stage."""
    if first:
        return 0.0
    graph = layer_graph(profile, shape, tp)
    if graph is None or profile.grad_reentry_s <= 0:
        return (4 * layers + (1 if last else 0)) * profile.backward_call_s
    n, w = graph
    head = HEAD_WEIGHT_NODES if last else 0
    walked = n * (w * layers * layers / 2 + head * layers)
    return (w * layers + head) * profile.grad_reentry_s + walked * profile.graph_walk_s
