"""Split backward of one pipeline stage: B (input gradient) now, W (weight gradients) later.

Zero Bubble pipeline parallelism (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", ICLR,
Sec. 2) splits the backward pass of a stage into B, the gradient with respect to the stage
input (on the critical path: the previous stage waits for it), and W, the gradients with
respect to the weights (off the critical path: it only has to finish before the optimizer
step), so W can fill pipeline bubbles.

How it is done here, on any stage module, without changing the model code:

* At B, the autograd graph from the stage output down to the stage's boundary tensor (the
  received input; any tensor works -- a non-leaf boundary's own subgraph, e.g. an
  embedding under it, becomes weight work for W) is analysed once, one walk. A
  node is on the *input path* if it reaches the boundary. A *frontier* node is an input-path
  node with at least one child that reaches parameters but not the boundary (e.g. the addmm
  of a linear layer: one child leads to the input, one to the weight).
* B runs ``torch.autograd.grad(out, boundary)``. The engine only executes nodes that lead
  to the boundary and asks each node for the gradients of needed edges only, so no weight
  gradient is computed. A pre-hook on every frontier node keeps the gradient that arrives at
  it (its ``grad_outputs``).
* W re-enters the graph at each frontier node (``GradientEdge``) with the kept gradient and
  asks only for that node's parameters, so the node now computes only its weight edges. One
  call per frontier node: a single call from all frontier nodes would also re-run the input
  path of upper nodes towards the parameters of lower ones and count them twice.

Because the same backward nodes compute the weight gradients from the same incoming
gradients, W's results equal the fused backward's bit for bit. Custom autograd functions that
fuse an input-gradient collective with a weight gradient (the tensor-parallel linears) read
``impls.common.backward_pass`` to do only the pass's part. The graph is kept alive
(``retain_graph``) between B and W -- the activation memory that zero-bubble schedules
trade for the smaller bubble.
"""
from __future__ import annotations

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from impls.common import backward_pass


def _analyse(root, target, param_index: dict[int, int]):
    """Frontier nodes of the graph under ``root`` relative to the boundary node ``target``.

    Returns ``(frontier, below_target)``: frontier is a list of (node, param indices reached
    through its weight-only children); below_target the param indices under ``target``.
    One iterative post-order walk; parameter sets are bit masks.
    """
    info: dict = {}  # node -> (reaches the boundary, bit mask of parameters below)
    stack = [root]
    while stack:
        node = stack[-1]
        if node in info:
            stack.pop()
            continue
        if node is target:
            info[node] = (True, _mask_under(node, param_index))
            stack.pop()
            continue
        children = node.next_functions
        pending = False
        for child, _ in children:
            if child is not None and child not in info:
                stack.append(child)
                pending = True
        if pending:
            continue
        stack.pop()
        var = getattr(node, "variable", None)
        mask = 1 << param_index[id(var)] if var is not None and id(var) in param_index else 0
        reach = False
        for child, _ in children:
            if child is not None:
                c_reach, c_mask = info[child]
                reach = reach or c_reach
                mask |= c_mask
        info[node] = (reach, mask)
    frontier = []
    for node, (reach, _) in info.items():
        if node is target or not reach:
            continue
        weight_only = via_input = 0
        for child, _ in node.next_functions:
            if child is None:
                continue
            c_reach, c_mask = info[child]
            if c_reach:
                via_input |= c_mask
            else:
                weight_only |= c_mask
        if weight_only:
            if weight_only & via_input:
                raise NotImplementedError(
                    "split backward: a parameter is used both above and below a node on the "
                    "input path (shared weights inside one stage); use a fused-backward schedule")
            frontier.append((node, _bits(weight_only)))
    return frontier, _bits(info.get(target, (True, 0))[1])


def _bits(mask: int) -> list[int]:
    return [i for i in range(mask.bit_length()) if mask >> i & 1]


def _mask_under(node, param_index) -> int:
    mask, stack, seen = 0, [node], set()
    while stack:
        n = stack.pop()
        if n is None or n in seen:
            continue
        seen.add(n)
        var = getattr(n, "variable", None)
        if var is not None and id(var) in param_index:
            mask |= 1 << param_index[id(var)]
        stack.extend(c for c, _ in n.next_functions)
    return mask


class SplitBackward:
    """B and W of one (micro-batch, stage): ``input_grad(grad_out)`` then ``weight_grads()``.

    ``boundary`` is the stage's input (a leaf that requires grad, or a non-leaf such as an
    embedding output); ``params`` the parameter tensors the forward used.
    """

    def __init__(self, out: torch.Tensor, boundary: torch.Tensor, params: list[torch.Tensor]):
        self.out = out
        self.boundary = boundary
        self.params = params
        self._groups: list[tuple[object, tuple, list[int]]] = []

    def input_grad(self, grad_out: torch.Tensor | None) -> torch.Tensor:
        edge = get_gradient_edge(self.boundary)
        index = {id(p): i for i, p in enumerate(self.params)}
        frontier, below = _analyse(self.out.grad_fn, edge.node, index)
        captured: dict[int, tuple] = {}
        handles = []
        for i, (node, _) in enumerate(frontier):
            def hook(grad_outputs, i=i):
                captured[i] = tuple(grad_outputs)
            handles.append(node.register_prehook(hook))
        try:
            with backward_pass.running(backward_pass.INPUT):
                (dx,) = torch.autograd.grad(self.out, [self.boundary], grad_out,
                                            retain_graph=True)
        finally:
            for h in handles:
                h.remove()
        self._groups = [(node, captured[i], idx) for i, (node, idx) in enumerate(frontier)
                        if i in captured]
        if below:  # first stage: the embedding under the boundary is weight work
            self._groups.append((edge, (dx,), below))
        self.out = None
        return dx

    def weight_grads(self) -> list[torch.Tensor | None]:
        grads: list[torch.Tensor | None] = [None] * len(self.params)
        for node, gouts, idx in self._groups:
            if isinstance(node, GradientEdge):
                edges, gs = [node], list(gouts)
            else:
                pairs = [(GradientEdge(node, k), g) for k, g in enumerate(gouts) if g is not None]
                if not pairs:
                    continue
                edges, gs = [e for e, _ in pairs], [g for _, g in pairs]
            with backward_pass.running(backward_pass.WEIGHT):
                res = torch.autograd.grad(edges, [self.params[j] for j in idx], gs,
                                          retain_graph=True, allow_unused=True)
            for j, g in zip(idx, res):
                if g is None:
                    continue
                grads[j] = g if grads[j] is None else grads[j] + g
        self._groups = []
        self.boundary = None
        return grads


def fused_grads(out: torch.Tensor, boundary: torch.Tensor | None, params: list[torch.Tensor],
                grad_out: torch.Tensor | None):
    """The ordinary backward (BW): (input gradient or None, parameter gradients)."""
    inputs = list(params) + ([boundary] if boundary is not None else [])
    res = torch.autograd.grad(out, inputs, grad_out, allow_unused=True)
    if boundary is not None:
        return res[-1], list(res[:-1])
    return None, list(res)


def fused_backward_into_grad(out: torch.Tensor, boundary: torch.Tensor | None,
                             params: list[torch.Tensor], grad_out: torch.Tensor | None):
    """BW accumulating straight into ``p.grad`` (as ``loss.backward()`` does); returns the
    input gradient. ``boundary`` must be a leaf (the received activation) or None."""
    inputs = list(params) + ([boundary] if boundary is not None else [])
    torch.autograd.backward(out, grad_out, inputs=inputs)
    return boundary.grad if boundary is not None else None
