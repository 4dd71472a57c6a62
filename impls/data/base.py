"""The base of the data-parallel family: the dp group, this rank's place in it, and its
micro-batches of the global batch (each replica trains on an equal slice)."""
from __future__ import annotations

import torch

from parbench.batching import dp_slice, microbatches
from parbench.config import MODEL_FEATURES, ConfigError
from parbench.model import counted_tokens
from parbench.probes import ModuleProbe, microbatch_rows, reference_probes
from parbench.scheme import Scheme


class DataParallelScheme(Scheme):
    """Holds ``group`` (the dp process group), ``dp_size`` and ``dp_rank``."""

    family = "data"
    uses = ("dp",)

    def __init__(self, ctx):
        super().__init__(ctx)
        self.group = ctx.mesh.group("dp")
        self.dp_size = ctx.mesh.size("dp")
        self.dp_rank = ctx.mesh.index("dp")

    supports_loss_mask = True
    #: a replica runs whole samples through the reference model, which finds each sample's
    #: documents in its tokens (``parbench.model.packing``)
    supports_packing = True
    model_features = MODEL_FEATURES | {"mla"}  # the reference model runs them all

    def local_microbatches(self, inputs: torch.Tensor, targets: torch.Tensor):
        """This rank's micro-batches of the global batch; notes the global batch's counted
        tokens for ``loss_scale``."""
        self.global_tokens = counted_tokens(targets)
        dev = self.ctx.device
        x = dp_slice(inputs, self.dp_rank, self.dp_size).to(dev)
        y = dp_slice(targets, self.dp_rank, self.dp_size).to(dev)
        return microbatches(x, y, self.ctx.layout.num_microbatches)

    def probes_of(self, model: torch.nn.Module) -> list[ModuleProbe]:
        """``model``'s modules (the whole reference GPT, parameter names kept) as probes
        (``Scheme.module_probes``): each micro-batch's call computes that micro-batch's rows
        of this rank's slice of the global batch; its loss is its own rows' mean, so its
        input gradients are dp times the golden run's (``grad_scale`` 1/dp)."""
        rows = self.ctx.layout.global_batch_size // self.dp_size
        calls = microbatch_rows(self.dp_rank * rows, rows, self.ctx.layout.num_microbatches)
        return reference_probes(model, calls, grad_scale=1.0 / self.dp_size)

    def loss_scale(self, ym: torch.Tensor) -> float:
        """What a micro-batch's mean token loss is multiplied by so that, after the gradients
        are averaged over dp, they are those of the global batch's mean token loss: 1/m when
        every token counts; with a loss mask, n_mb dp / N (n_mb: the micro-batch's counted
        tokens, N: the global batch's) -- Megatron-LM's --calculate-per-token-loss, where
        the token count is all-reduced; here every rank holds the global batch, so N needs
        no collective."""
        if not self.ctx.run.loss_mask:
            return 1.0 / self.ctx.layout.num_microbatches
        return counted_tokens(ym) * self.dp_size / self.global_tokens

    def forward_backward(self, model, xm: torch.Tensor, ym: torch.Tensor, mb: int) -> float:
        """Forward and backward of micro-batch ``mb`` with its loss scaled by ``loss_scale``
        (1/m: the accumulated gradients are the mean over the rank's batch; timeline spans F
        and B); returns the scaled loss."""
        tl = self.ctx.timeline
        with tl.span("F", mb=mb):
            loss = model(xm, ym) * self.loss_scale(ym)
        with tl.span("B", mb=mb):
            loss.backward()
        return float(loss.detach())


class ReplicaScheme(DataParallelScheme):
    """A data-parallel scheme whose rank holds a whole ``self.model`` with ordinary
    ``.grad``s: the full parameters and gradients are its own."""

    model: torch.nn.Module

    @classmethod
    def check(cls, case) -> None:
        super().check(case)
        if case.run.dtype != "fp32":  # issue 20, sec. 8: a field a scheme ignores is refused
            raise ConfigError(f"dtype={case.run.dtype!r} is not supported by {cls.name}: its "
                              "replicas train fp32 (mixed precision: zero.1, zero.2, zero.3)")

    def module_probes(self):
        return self.probes_of(self.model)

    def full_params(self):
        return {n: p.detach() for n, p in self.model.named_parameters()}

    def full_grads(self):
        return {n: p.grad.detach() for n, p in self.model.named_parameters()}
