"""The Scheme contract and the registry of native schemes and baselines.

A scheme builds its shard of the reference model from the same full weights (the seeded
initialisation of ``parbench.model``), runs one optimizer step per ``train_step`` on the
global batch, and hands back what it holds, unsharded, for comparison with the golden run.
Process groups come from ``ctx.mesh`` explicitly; there is no global parallel state.
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .config import CaseConfig, ConfigError
from .mesh import Mesh
from .timeline import Timeline


@dataclass
class SchemeContext:
    case: CaseConfig
    mesh: Mesh
    device: torch.device
    timeline: Timeline

    @property
    def model(self):
        return self.case.model

    @property
    def parallel(self):
        return self.case.parallel

    @property
    def run(self):
        return self.case.run

    @property
    def rank(self) -> int:
        return self.mesh.rank


class Scheme:
    """Base class. Subclasses set ``name`` and ``family`` and implement the four methods."""

    name: str = ""
    family: str = ""
    baseline_of: str | None = None  # for baselines: the native scheme they are compared with
    description: str = ""
    #: the degrees this scheme uses; others must be 1 (checked before spawning)
    uses: tuple[str, ...] = ("dp",)
    #: True for baselines that keep process-global state (DeepSpeed engines): the runner gives
    #: each such case a fresh pool of ranks instead of the shared one
    isolated: bool = False

    def __init__(self, ctx: SchemeContext):
        self.ctx = ctx

    # ---- the contract ---------------------------------------------------------------------
    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor, step: int) -> float | None:
        """One optimizer step on the *global* batch; returns the global mean loss (or None on
        ranks that do not hold it)."""
        raise NotImplementedError

    def full_params(self) -> dict[str, torch.Tensor]:
        """Unsharded parameters this rank can produce (name -> tensor); may be partial (a
        pipeline stage). May be collective: every rank calls it."""
        raise NotImplementedError

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Unsharded gradients used by the last optimizer step, same naming."""
        raise NotImplementedError

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """This rank's model states: {'params': [...], 'grads': [...], 'optimizer': [...]}."""
        raise NotImplementedError

    # ---- optional -------------------------------------------------------------------------
    @classmethod
    def check(cls, case: CaseConfig) -> None:
        """Reject a case before spawning (raise ConfigError naming field, value, rule)."""
        p = case.parallel
        for axis in ("tp", "cp", "ep", "pp"):
            if axis not in cls.uses and getattr(p, axis) != 1:
                raise ConfigError(f"{axis}={getattr(p, axis)} is not used by scheme "
                                  f"{cls.name} (it uses {', '.join(cls.uses)}); set {axis}=1")

    @classmethod
    def predict(cls, case: CaseConfig) -> dict:
        """Analytic figures for one step of this case: {'wire_bytes': {axis: bytes per rank},
        'model_state_bytes': {category: bytes per rank}} (keys optional)."""
        return {}

    @classmethod
    def reference(cls, case: CaseConfig, steps: int):
        """The golden run this scheme must equal (default: single-device synchronous)."""
        from .golden import reference_run
        return reference_run(case, steps)

    def extra_metrics(self) -> dict:
        """Scheme-specific measurements for the results row (e.g. bubble figures)."""
        return {}

    # ---- helpers --------------------------------------------------------------------------
    def reduce_loss(self, value: float | torch.Tensor, group=None, op=dist.ReduceOp.SUM) -> float:
        """All-reduce a loss for reporting, outside the ledger (not part of the scheme)."""
        from . import comm
        t = torch.tensor([float(value)], dtype=torch.float64)
        led = comm.active()
        if led is not None:
            with led.pause():
                dist.all_reduce(t, op=op, group=group)
        else:
            dist.all_reduce(t, op=op, group=group)
        return float(t.item())


_REGISTRY: dict[str, type[Scheme]] = {}
_LOADED = False


def register(cls: type[Scheme]) -> type[Scheme]:
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    _REGISTRY[cls.name] = cls
    return cls


def _load_all() -> None:
    global _LOADED
    if _LOADED:
        return
    import impls
    for pkg in (impls, importlib.import_module("impls.baselines")):
        for mod in pkgutil.iter_modules(pkg.__path__):
            if not mod.ispkg:
                importlib.import_module(f"{pkg.__name__}.{mod.name}")
    _LOADED = True


def get_scheme(name: str) -> type[Scheme]:
    _load_all()
    if name not in _REGISTRY:
        raise ConfigError(f"scheme={name!r} is not registered (choose from "
                          f"{', '.join(sorted(_REGISTRY))})")
    return _REGISTRY[name]


def all_schemes() -> dict[str, type[Scheme]]:
    _load_all()
    return dict(sorted(_REGISTRY.items()))
