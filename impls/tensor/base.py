"""What the tensor-parallel schemes share: the tp group, micro-batches of the global batch, the
step (forward / backward per micro-batch, loss scaled by 1/m or its token share, one AdamW
step over the local shards), the unsharded tensors for the verdict and the per-layer
activation measurement.

With ``loss_mask`` each micro-batch's loss is the mean over its counted tokens (targets not
``IGNORE_INDEX``) scaled by its share of the global batch's counted tokens (:meth:`loss_scale`),
so that the step's gradient is that of the mean over the global batch's counted tokens:
Megatron-LM's ``--calculate-per-token-loss``, whose token count needs no collective here (every
rank holds the global batch). Schemes whose model honours the mask set ``supports_loss_mask``.

A subclass builds ``self.model`` (a module whose ``shards()`` maps every full parameter name
to its local tensor and placement, and whose ``layer_probe`` hook lets the base wrap each
layer's forward in a saved-tensor measurement) and may override ``after_backward`` (the
gradient reductions a scheme makes once per step).

With ``clip_grad`` the step clips by global norm after those reductions (:meth:`clip`): a
rank sums the squares of the pieces it is the first holder of (its shards, and a parameter
replicated over tp on tp rank 0 only) and the sum is all-reduced over the tp group -- the
rule of Megatron-LM's ``clip_grad_norm_fp32``, which counts a tp-duplicated parameter once
(``param_is_not_tensor_parallel_duplicate``) and all-reduces the squared norm over the
model-parallel group. Schemes that clip set ``supports_clip_grad``.
"""
from __future__ import annotations

import torch

from parbench import comm
from parbench.batching import microbatches
from parbench.config import CaseConfig, ConfigError
from parbench.memory import SavedActivations
from parbench.model import counted_tokens, make_optimizer
from parbench.scheme import Scheme

from impls.common.clip import clip_grads_

from .shards import first_holder, gather_full


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
        self._norm_params: list | None = None

    # ---- to override ---------------------------------------------------------------------
    def build_model(self) -> torch.nn.Module:
        raise NotImplementedError

    def make_optimizer(self, params):
        return make_optimizer(params, self.ctx.run)

    def after_backward(self) -> None:
        """Gradient reductions made once per step, after the last micro-batch."""

    def forward(self, inputs, targets) -> torch.Tensor:
        """The mean loss over the micro-batch's counted tokens (its part of it: a grid rank's
        batch block, summed over the grid by the gradient reductions)."""
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

    def loss_scale(self, ym: torch.Tensor) -> float:
        """What a micro-batch's mean token loss is multiplied by: 1/m when every token
        counts; with ``loss_mask``, n_mb / N (n_mb: the micro-batch's counted tokens, N: the
        global batch's, noted by ``train_step``) -- Megatron-LM's
        ``--calculate-per-token-loss``, whose all-reduced token count every rank has here."""
        if not self.ctx.run.loss_mask:
            return 1.0 / self.ctx.layout.num_microbatches
        return counted_tokens(ym) / self.global_tokens

    def train_step(self, inputs, targets, step):
        dev, tl = self.ctx.device, self.ctx.timeline
        m = self.ctx.layout.num_microbatches
        self.global_tokens = counted_tokens(targets)
        for p in self.params:
            p.grad = None
        total = 0.0
        for i, (xm, ym) in enumerate(microbatches(inputs.to(dev), targets.to(dev), m)):
            self._measuring = step == 0 and i == 0
            self._probes = []
            self.model.layer_probe = self._probe if self._measuring else None
            with tl.span("F", mb=i):
                loss = self.forward(xm, ym) * self.loss_scale(ym)
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
            self.clip()
            self.opt.step()
        return total

    # ---- gradient clipping by global norm -------------------------------------------------
    def norm_params(self) -> list:
        """The local parameters whose gradients this rank adds to the norm: those whose
        piece no lower tp index holds (``shards.first_holder``), so the sum over the tp group
        counts every element of the model once."""
        if self._norm_params is None:
            self._norm_params = [local for local, pl in self.model.shards().values()
                                 if first_holder(pl, self.tp_rank)]
        return self._norm_params

    def norm_groups(self) -> list:
        """The groups the squared norm is all-reduced over: the tp group (one call)."""
        return [self.group]

    def clip(self) -> None:
        """Clip every local gradient by the global norm (``clip_grad``; nothing when 0),
        after the per-step reductions, so each rank scales the gradients it steps on and
        reports (``full_grads``) by the same factor."""
        clip = self.ctx.run.clip_grad
        if not clip:
            return
        owned = [p.grad for p in self.norm_params() if p.grad is not None]
        clip_grads_([p.grad for p in self.params], clip, owned=owned,
                    groups=self.norm_groups())

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
