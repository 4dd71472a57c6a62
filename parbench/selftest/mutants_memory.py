"""Memory bugs the model-state check must catch wherever the copy hides (issue 20, sec. 7):
state held by a callable rather than an attribute -- a closure an optimizer hook keeps, a
``functools.partial``. The numbers stay right; only the tracker sees the bytes."""
from __future__ import annotations

import functools

import torch

from impls.data.ddp import NativeDDP

from .catalogue import mutant


@mutant("ddp-rollback-snapshot-in-hook", base="data.ddp",
        bug="a NaN-rollback guard registered as an optimizer step pre-hook keeps a full copy "
            "of the parameters in its closure (refreshed every step, never freed)")
class DDPRollbackSnapshot(NativeDDP):
    def __init__(self, ctx):
        super().__init__(ctx)
        snapshot = [p.detach().clone() for p in self.params]

        def keep(_opt, _args, _kwargs):
            with torch.no_grad():
                for s, p in zip(snapshot, self.params):
                    s.copy_(p)

        self.opt.register_step_pre_hook(keep)


@mutant("ddp-restore-partial", base="data.ddp",
        bug="a restore callback built with functools.partial over a full copy of the "
            "initial parameters is kept for a rollback that never comes")
class DDPRestorePartial(NativeDDP):
    def __init__(self, ctx):
        super().__init__(ctx)
        initial = [p.detach().clone() for p in self.params]
        self.restore = functools.partial(torch._foreach_copy_, self.params, initial)
