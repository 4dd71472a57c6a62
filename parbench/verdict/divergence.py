"""Name the first diverging module (issue 20, section 5).

When a case fails on a checked step, ``parbench.harness.probe_case`` reruns its checked steps
up to that step with hooks on the modules the scheme maps (``Scheme.module_probes``,
``parbench.probes``). At each step, each rank compares what its modules computed with the
golden model at the scheme's own weights before the step (the stepwise golden's weights, so
only the summation order differs and the tolerance is that of the gradients: tensor-wise
``atol + rtol * max|golden|``):

1. forward outputs, module by module in the reference model's forward order;
2. then the gradients that reach each module's input, in backward order.

The first module out of tolerance -- at the earliest step, then forward before backward, then
in that order, then on the lowest rank -- is the case's ``Divergence``: "forward output of
blocks.1.attn (rank 1, step 0)". When every mapped module agrees, the difference arises after
backward (the gradients' reduction, the optimizer), and the divergence says so. This is the
bisection a debugging engineer does by hand, layer by layer.
"""
from __future__ import annotations

from collections import defaultdict

import torch

from ..results import Divergence

FORWARD, BACKWARD = "forward output", "input gradient"


class Recorder:
    """Each named module's forward outputs and input gradients, per call, while attached."""

    def __init__(self, modules: list[tuple[str, torch.nn.Module]]):
        self.outputs: dict[str, list[torch.Tensor]] = defaultdict(list)
        self.input_grads: dict[str, list[torch.Tensor]] = defaultdict(list)
        #: module names in the order of their first forward call
        self.order: list[str] = []
        self._handles = []
        for name, mod in modules:
            self._handles.append(mod.register_forward_pre_hook(self._on_input(name)))
            self._handles.append(mod.register_forward_hook(self._on_output(name)))

    def _on_input(self, name: str):
        def hook(_mod, args):
            x = args[0] if args else None
            if torch.is_tensor(x) and x.requires_grad:
                x.register_hook(lambda g: self.input_grads[name].append(g.detach().clone()))
        return hook

    def _on_output(self, name: str):
        def hook(_mod, _args, out):
            if name not in self.order:
                self.order.append(name)
            if torch.is_tensor(out):
                self.outputs[name].append(out.detach().clone())
        return hook

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def _excess(ours: torch.Tensor, ref: torch.Tensor, run) -> tuple[float, float] | None:
    """(max|ours - ref|, tolerance) when out of tolerance, else None."""
    a, b = ours.detach().double().cpu(), ref.detach().double().cpu()
    if a.shape != b.shape or not b.numel():
        return (float("inf"), 0.0) if a.shape != b.shape else None
    d = float((a - b).abs().max())
    tol = run.atol + run.rtol * float(b.abs().max())
    return None if d <= tol else (d, tol)


def first_divergence(probes, ours: Recorder, golden: Recorder, run, step: int, rank: int
                     ) -> Divergence | None:
    """This rank's first diverging module at ``step`` (module docstring); None: all agree."""
    by_name = {p.name: p for p in probes}
    order = [n for n in golden.order if n in by_name]
    for where, names, mine, ref in ((FORWARD, order, ours.outputs, golden.outputs),
                                    (BACKWARD, order[::-1], ours.input_grads,
                                     golden.input_grads)):
        for name in names:
            probe, full = by_name[name], ref.get(name)
            if not full or full[0].dim() == 0:
                continue  # no golden tensor per row (the head's loss, the tokens' gradient)
            scale = probe.grad_scale if where == BACKWARD else 1.0
            for call, got in zip(probe.calls, mine.get(name, [])):
                bad = _excess(probe.batch_first(got) * scale, full[0][call], run)
                if bad is not None:
                    return Divergence(where, name, step, rank, *bad)
    return None


def earliest(found: list[Divergence | None], module_order: list[str]) -> Divergence | None:
    """The case's first divergence from every rank's (``module_order``: the reference model's
    forward order, so that a pipeline's stages compare across ranks)."""
    place = {n: i for i, n in enumerate(module_order)}

    def key(d: Divergence):
        i = place.get(d.module, len(place))
        return (d.step, d.where != FORWARD, i if d.where == FORWARD else -i, d.rank)
    real = [d for d in found if d is not None]
    return min(real, key=key) if real else None
