"""The Scheme contract, the prediction a scheme states, and the registry.

A scheme builds its shard of the reference model from the same full weights (the seeded
initialisation of ``parbench.model``), runs one optimizer step per ``train_step`` on the
global batch, and hands back what it holds, unsharded, for comparison with the golden run.
Process groups come from ``ctx.mesh`` explicitly; there is no global parallel state.

Optional behaviour is a method of the base class with a neutral default (``check``,
``predict``, ``reference``, ``metrics``, ``figures``), never an attribute probed with
``hasattr``.
"""
from __future__ import annotations

import importlib
import importlib.util
import pkgutil
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch

from .config import CaseConfig, ConfigError
from .mesh import Mesh
from .timeline import Timeline


@dataclass
class SchemeContext:
    """What a scheme is built with: the case, the mesh (process groups), device, timeline."""

    case: CaseConfig
    mesh: Mesh
    device: torch.device
    timeline: Timeline

    @property
    def model(self):
        return self.case.model

    @property
    def layout(self):
        return self.case.layout

    @property
    def options(self):
        return self.case.options

    @property
    def parallel(self):
        raise AttributeError("SchemeContext.parallel was split: the degrees, micro-batches and "
                             "schedule are ctx.layout (parbench.layout.Layout), the options "
                             "ctx.options.<family> (parbench.options)")

    @property
    def run(self):
        return self.case.run

    @property
    def rank(self) -> int:
        return self.mesh.rank


@dataclass
class Prediction:
    """What a scheme's closed forms say one rank measures in one step.

    ``wire_bytes[r]`` and ``model_state_bytes[r]`` are rank r's figures ({axis: bytes} and
    {category: bytes}); the ``*_by_step[s][r]`` lists override them for schemes whose figures
    change from step to step (local SGD's sync steps, a continuous pipeline's fill and
    drain). ``figures`` holds further analytic numbers for the report (the paper's
    accounting, parameter counts, ...).
    """

    wire_bytes: list[dict[str, float]] | None = None
    model_state_bytes: list[dict[str, int]] | None = None
    #: per rank, calls that carry bytes per axis (sends and collectives; not receives)
    calls: list[dict[str, int]] | None = None
    wire_bytes_by_step: list[list[dict[str, float]]] | None = None
    calls_by_step: list[list[dict[str, int]]] | None = None
    model_state_bytes_by_step: list[list[dict[str, int]]] | None = None
    figures: dict = field(default_factory=dict)

    @classmethod
    def uniform(cls, world_size: int, wire: dict[str, float] | None = None,
                states: dict[str, int] | None = None, calls: dict[str, int] | None = None,
                **figures) -> "Prediction":
        """The same figures on every rank (data parallelism)."""
        def each(d):
            return None if d is None else [dict(d) for _ in range(world_size)]
        return cls(wire_bytes=each(wire), model_state_bytes=each(states), calls=each(calls),
                   figures=figures)

    @staticmethod
    def _at(by_step, default, step: int):
        if by_step is not None:
            return by_step[min(step, len(by_step) - 1)]
        return default

    def wire_at(self, step: int) -> list[dict[str, float]] | None:
        """Per-rank wire bytes predicted for checked step ``step``."""
        return self._at(self.wire_bytes_by_step, self.wire_bytes, step)

    def calls_at(self, step: int) -> list[dict[str, int]] | None:
        return self._at(self.calls_by_step, self.calls, step)

    def states_at(self, step: int) -> list[dict[str, int]] | None:
        """Per-rank model states after checked step ``step``."""
        return self._at(self.model_state_bytes_by_step, self.model_state_bytes, step)

    def max_wire(self, step: int) -> dict[str, float] | None:
        """Largest rank's bytes per axis at ``step``."""
        per_rank = self.wire_at(step)
        if not per_rank:
            return None
        axes = sorted({a for w in per_rank for a in w})
        return {a: max(w.get(a, 0.0) for w in per_rank) for a in axes}


class Scheme(ABC):
    """Base class of every native scheme and baseline. Subclasses set the class attributes
    and implement the three abstract methods."""

    name: ClassVar[str] = ""
    family: ClassVar[str] = ""
    #: for baselines: the native scheme they are compared with
    baseline_of: ClassVar[str | None] = None
    description: ClassVar[str] = ""
    #: the mesh axes this scheme uses; the other degrees must be 1 (checked before spawning)
    uses: ClassVar[tuple[str, ...]] = ("dp",)
    #: the option fields this scheme reads, by bare name: fields of the option dataclasses
    #: (``parbench.options``) and ``config.OPTIONAL_FIELDS``; checked when registered
    options: ClassVar[tuple[str, ...]] = ()
    #: True for baselines that keep process-global state (DeepSpeed engines): the runner
    #: gives each such case a fresh pool of ranks instead of the shared one
    isolated: ClassVar[bool] = False
    #: each train_step applies the run's optimizer once to the gradients ``full_grads``
    #: reports, so the verdict checks the update against a shadow optimizer
    #: (``checks.UpdateCheck``); False for schemes with another update rule (local SGD's
    #: averaging, PipeDream's per-micro-batch updates), whose golden runs simulate the rule
    checks_update: ClassVar[bool] = True
    #: runs MoE models (``num_experts > 0``); other schemes reject them before spawning
    supports_moe: ClassVar[bool] = False

    def __init__(self, ctx: SchemeContext):
        self.ctx = ctx

    # ---- the contract ---------------------------------------------------------------------
    @abstractmethod
    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor, step: int) -> float | None:
        """One optimizer step on the *global* batch; returns the global mean loss (or None on
        ranks that do not hold it)."""

    @abstractmethod
    def full_params(self) -> dict[str, torch.Tensor]:
        """Unsharded parameters this rank can produce (name -> tensor); may be partial (a
        pipeline stage). May be collective: every rank calls it."""

    @abstractmethod
    def full_grads(self) -> dict[str, torch.Tensor]:
        """Unsharded gradients used by the last optimizer step, same naming."""

    # ---- optional, with neutral defaults ----------------------------------------------------
    @classmethod
    def check(cls, case: CaseConfig) -> None:
        """Reject a case before spawning (raise ConfigError naming field, value, rule)."""
        p = case.layout
        for axis in ("tp", "cp", "ep", "pp"):
            if axis not in cls.uses and getattr(p, axis) != 1:
                raise ConfigError(f"{axis}={getattr(p, axis)} is not used by scheme "
                                  f"{cls.name} (it uses {', '.join(cls.uses)}); set {axis}=1")
        if case.model.num_experts and not cls.supports_moe:
            raise ConfigError(f"num_experts={case.model.num_experts}: scheme {cls.name} runs "
                              "dense models (MoE: expert.alltoall, hybrid)")

    @classmethod
    def routing_groups(cls, case: CaseConfig):
        """The MoE routing groups of this scheme, as the golden run must cut the batch: by
        default one group per rank and micro-batch (``parbench.moe``)."""
        from .moe import RoutingGroups
        return RoutingGroups(rows=case.layout.micro_batch_size)

    @classmethod
    def unavailable(cls) -> str | None:
        """Why this scheme cannot run here (an optional dependency is missing), else None;
        ``parbench run`` skips its cases, saying why."""
        return None

    @classmethod
    def predict(cls, case: CaseConfig) -> Prediction | None:
        """Closed-form figures for one step of this case (None: no prediction)."""
        return None

    @classmethod
    def reference(cls, case: CaseConfig, steps: int):
        """The golden run this scheme must equal (default: single-device synchronous)."""
        from .golden import reference_run
        return reference_run(case, steps)

    def state_tensors(self) -> dict[str, list[torch.Tensor]] | None:
        """The tensors this rank keeps between steps, by category (``params``, ``grads``,
        ``optimizer``, ``other``), each storage counted once. None (the default): the memory
        tracker finds them itself, walking everything reachable from the scheme object
        (``parbench.memory.live_model_states``)."""
        return None

    def metrics(self) -> dict:
        """Scheme-specific measurements for the results row (e.g. bubble figures)."""
        return {}

    @classmethod
    def figures(cls, case: CaseConfig, per_rank: list, out_dir: Path) -> list[Path]:
        """Scheme-specific figures written under ``out_dir`` (``per_rank``: RankResults)."""
        return []

    # ---- helpers --------------------------------------------------------------------------
    def reduce_loss(self, value: float | torch.Tensor, group=None) -> float:
        """Sum a loss over ``group`` for reporting, outside the ledger (not the scheme's
        traffic)."""
        import torch.distributed as dist

        from . import comm
        t = torch.tensor([float(value)], dtype=torch.float64)
        with comm.unrecorded():
            dist.all_reduce(t, group=group)
        return float(t.item())


# ---- the registry -------------------------------------------------------------------------

_REGISTRY: dict[str, type[Scheme]] = {}
_LOADED = False


def register(cls: type[Scheme]) -> type[Scheme]:
    """Class decorator: make ``cls`` available by its ``name``."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    check_declared_options(cls)
    _REGISTRY[cls.name] = cls
    return cls


def check_declared_options(cls: type[Scheme]) -> None:
    """Every option a scheme declares is a real field (a typo is an error at import)."""
    from .config import OPTIONAL_FIELDS
    from .options import option_names
    known = set(option_names()) | set(OPTIONAL_FIELDS)
    unknown = [n for n in cls.options if n not in known]
    if unknown:
        raise ValueError(f"{cls.__name__}.options names {', '.join(unknown)}: not an option "
                         f"(options: {', '.join(sorted(known))})")


#: entry points of the group ``parbench.schemes`` that failed to load: name -> why
_BROKEN_ENTRY_POINTS: dict[str, str] = {}
ENTRY_POINT_GROUP = "parbench.schemes"


def _load_all() -> None:
    """Import every module under ``impls/`` (each registers its schemes on import), then the
    schemes installed packages declare in the entry-point group ``parbench.schemes``
    (``name = "pkg.module:Class"``; registered under the entry point's name)."""
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    import impls
    for mod in pkgutil.walk_packages(impls.__path__, prefix="impls."):
        importlib.import_module(mod.name)
    from importlib.metadata import entry_points
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            cls = ep.load()
            _check_scheme_class(cls, f"entry point {ep.name} = {ep.value}")
        except Exception as e:  # noqa: BLE001 -- reported when the scheme is asked for
            _BROKEN_ENTRY_POINTS[ep.name] = f"{type(e).__name__}: {e}"
            continue
        _REGISTRY.setdefault(ep.name, cls)


def _check_scheme_class(cls, where: str) -> None:
    if not (isinstance(cls, type) and issubclass(cls, Scheme)):
        raise ConfigError(f"{where} is {cls!r}, not a subclass of parbench.Scheme")
    if getattr(cls, "__abstractmethods__", None):
        raise ConfigError(f"{where} does not implement "
                          f"{', '.join(sorted(cls.__abstractmethods__))}")
    if not cls.family:
        raise ConfigError(f"{where} declares no family (set family = 'data', 'pipeline', "
                          "'tensor', 'context', 'expert' or 'hybrid')")


def is_external(name: str) -> bool:
    """``pkg.module:Class`` or ``path/to/file.py:Class``: a scheme loaded by its path."""
    return ":" in name


def _import_module(target: str, spec: str):
    """The module of ``target`` (a dotted name, or a .py file path)."""
    import sys
    if target.endswith(".py") or "/" in target or "\\" in target:
        path = Path(target).resolve()
        if not path.is_file():
            raise ConfigError(f"scheme={spec!r}: no file {target}")
        name = f"parbench_user_{path.stem}_{abs(hash(str(path))) % 10**8}"
        if name in sys.modules:
            return sys.modules[name]
        loader_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[name] = module
        try:
            loader_spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
        return module
    # like ``python -m``: a module in the working directory is importable
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    return importlib.import_module(target)


def load_external(spec: str) -> type[Scheme]:
    """A user's scheme class named ``pkg.module:Class`` or ``path/to/file.py:Class``,
    imported and registered under ``spec`` (every rank process resolves the same string).
    Bad input is one ConfigError naming what failed."""
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        raise ConfigError(f"scheme={spec!r} must be pkg.module:Class or path/to/file.py:Class")
    try:
        module = _import_module(target, spec)
    except ConfigError:
        raise
    except ModuleNotFoundError as e:
        if e.name and (target == e.name or target.startswith(e.name + ".")):
            raise ConfigError(f"scheme={spec!r}: no module named {e.name!r} (is it on "
                              "PYTHONPATH or installed?)") from None
        raise ConfigError(f"scheme={spec!r}: importing {target!r} raised "
                          f"ModuleNotFoundError: {e}") from None
    except BaseException as e:  # noqa: BLE001 -- a user's module may raise anything
        if isinstance(e, KeyboardInterrupt):
            raise
        raise ConfigError(f"scheme={spec!r}: importing {target!r} raised "
                          f"{type(e).__name__}: {e}") from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"scheme={spec!r}: {target!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    _check_scheme_class(obj, f"scheme={spec!r}")
    _REGISTRY[spec] = obj
    return obj


def get_scheme(name: str) -> type[Scheme]:
    _load_all()
    if name.startswith("mutant.") and name not in _REGISTRY:
        from .selftest.catalogue import load
        load()
    if name not in _REGISTRY and is_external(name):
        return load_external(name)
    if name in _BROKEN_ENTRY_POINTS and name not in _REGISTRY:
        raise ConfigError(f"scheme={name!r}: its entry point ({ENTRY_POINT_GROUP}) failed to "
                          f"load: {_BROKEN_ENTRY_POINTS[name]}")
    if name not in _REGISTRY:
        raise ConfigError(f"scheme={name!r} is not registered (choose from "
                          f"{', '.join(sorted(_REGISTRY))}, or give pkg.module:Class)")
    return _REGISTRY[name]


def all_schemes() -> dict[str, type[Scheme]]:
    """Every registered scheme but the self-test's mutants."""
    _load_all()
    return dict(sorted((n, c) for n, c in _REGISTRY.items() if not n.startswith("mutant.")))
