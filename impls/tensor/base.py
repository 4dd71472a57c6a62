"""What the tensor-parallel schemes share: the tp group, micro-batches of the global batch, the
step (forward / backward per micro-batch, loss scaled by 1/m, one AdamW step over the local
shards), the unsharded tensors for the verdict and the per-layer activation measurement.

A subclass builds ``self.model`` (a module whose ``shards()`` maps every full parameter name
to its local tensor and placement, and whose ``layer_probe`` hook lets the base wrap each
layer's forward in a saved-tensor measurement) and may override ``after_backward`` (the
gradient reductions a scheme makes once per step).
"""
from __future__ import annotations

import torch

from parbench import comm
from parbench.batching import microbatches
from parbench.config import CaseConfig, ConfigError
from parbench.memory import SavedActivations
from parbench.model import make_optimizer
from parbench.scheme import Scheme

from .shards import gather_full


class TensorParallelScheme(Scheme):
    family = "tensor"
    uses = ("tp",)
    options = ("recompute",)

    def __init__(self, ctx):
        super().__init__(ctx)
        self.group = ctx.mesh.group("tp")
        self.tp = ctx.mesh.size("tp")
        self.tp_rank = ctx.mesh.index("tp")
        self.model = self.build_model()
        self.params = [p for p in self.model.parameters()]
        self.opt = self.make_optimizer(self.params)
        #: per-layer bytes saved for backward, measured on the first micro-batch of step 0
        self._act_layers: list[int] = []
        self._measuring = False
        self._probes: list = []

    # ---- to override ---------------------------------------------------------------------
    def build_model(self) -> torch.nn.Module:
        raise NotImplementedError

    def make_optimizer(self, params):
        return make_optimizer(params, self.ctx.run)

    def after_backward(self) -> None:
        """Gradient reductions made once per step, after the last micro-batch."""

    def forward(self, inputs, targets) -> torch.Tensor:
        """The mean token loss of one micro-batch."""
        return self.model(inputs, targets)

    def backward(self, loss) -> None:
        loss.backward()

    @classmethod
    def check(cls, case: CaseConfig) -> None:
        super().check(case)
        p = case.layout
        if p.dp != 1:
            raise ConfigError(f"dp={p.dp} is not used by scheme {cls.name} (tensor parallelism "
                              "alone); set dp=1")
        if case.run.dtype != "fp32":
            raise ConfigError(f"dtype={case.run.dtype} is not supported by {cls.name} "
                              "(fp32 only)")

    # ---- the step --------------------------------------------------------------------------
    def install_layer_probes(self, layers) -> None:
        """For module-based models (the baselines): measure each of ``layers`` with forward
        hooks, as ``layer_probe`` does for the native model."""
        for i, layer in enumerate(layers):
            def pre(_mod, _args, i=i):
                probe = self._probe(i)
                if probe is not None:
                    probe.__enter__()
                    self._open = probe

            def post(_mod, _args, _out):
                probe, self._open = getattr(self, "_open", None), None
                if probe is not None:
                    probe.__exit__(None, None, None)
            layer.register_forward_pre_hook(pre)
            layer.register_forward_hook(post)

    def _probe(self, i: int):
        if not self._measuring:
            return None
        probe = SavedActivations(exclude=self.params)
        self._probes.append(probe)
        return probe

    def train_step(self, inputs, targets, step):
        dev, tl = self.ctx.device, self.ctx.timeline
        m = self.ctx.layout.num_microbatches
        for p in self.params:
            p.grad = None
        total = 0.0
        for i, (xm, ym) in enumerate(microbatches(inputs.to(dev), targets.to(dev), m)):
            self._measuring = step == 0 and i == 0
            self._probes = []
            self.model.layer_probe = self._probe if self._measuring else None
            with tl.span("F", mb=i):
                loss = self.forward(xm, ym) / m
            self.model.layer_probe = None
            if self._measuring:
                self._act_layers = [p.bytes for p in self._probes]
            self._probes = []
            with tl.span("B", mb=i):
                self.backward(loss)
            total += float(loss.detach())
        with tl.span("reduce"):
            self.after_backward()
        with tl.span("optim"):
            self.opt.step()
        return total

    # ---- the verdict's view ------------------------------------------------------------------
    def _full(self, grads: bool) -> dict[str, torch.Tensor]:
        """Every full tensor, named as in the reference model (collective over tp)."""
        named = {}
        for name, (local, pl) in self.model.shards().items():
            t = local.grad if grads else local
            named[name] = (t if t is not None else torch.zeros_like(local), pl)
        with comm.unrecorded():
            return gather_full(named, self.group, self.ctx.mesh.ranks("tp"), self.tp_rank)

    def full_params(self):
        return self._full(grads=False)

    def full_grads(self):
        return self._full(grads=True)

    def metrics(self) -> dict:
        out = {}
        if self._act_layers:
            out["act_layer_bytes"] = max(self._act_layers)
        out.update(self.activation_formula())
        return out

    def activation_formula(self) -> dict:
        """The closed form beside the measurement (``parbench.analytic.tensor``)."""
        return {}
