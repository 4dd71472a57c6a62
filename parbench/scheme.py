"""The Scheme contract, the prediction a scheme states, and ``register``.

A scheme builds its shard of the reference model from the same full weights (the seeded
initialisation of ``parbench.model``), runs one optimizer step per ``train_step`` on the
global batch, and hands back what it holds, unsharded, for comparison with the golden run.
Process groups come from ``ctx.mesh`` explicitly; there is no global parallel state.

Optional behaviour is a method of the base class with a neutral default (``check``,
``predict``, ``reference``, ``module_probes``, ``metrics``, ``figures``), never an attribute
probed with ``hasattr``.

``register`` fills the table of schemes by name as their modules are imported; finding them
(loading ``impls/``, entry points, a user's module, the mutants) is ``parbench.registry``'s
job, a floor above ``impls/``.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch
import torch.distributed as dist

from . import comm
from .config import OPTIONAL_FIELDS, CaseConfig, ConfigError
from .golden import GoldenRun, reference_run
from .mesh import Mesh
from .model.moe import RoutingGroups
from .options import option_names
from .probes import ModuleProbe
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
    drain). ``figures`` holds further analytic numbers for readers of the results
    (``Row.analytic``: the paper's accounting, parameter counts, ...);
    ``paper_model_state_bytes`` is one rank's model states in the paper's own accounting
    (ZeRO: (2 + 2 + K) Psi, K = 12), shown beside ours.
    """

    wire_bytes: list[dict[str, float]] | None = None
    model_state_bytes: list[dict[str, int]] | None = None
    #: per rank, calls that carry bytes per axis (sends and collectives; not receives)
    calls: list[dict[str, int]] | None = None
    wire_bytes_by_step: list[list[dict[str, float]]] | None = None
    calls_by_step: list[list[dict[str, int]]] | None = None
    model_state_bytes_by_step: list[list[dict[str, int]]] | None = None
    figures: dict = field(default_factory=dict)
    paper_model_state_bytes: float | None = None

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
    #: clips gradients by global norm (``clip_grad > 0``) before its optimizer step, its
    #: ``full_grads`` reporting the clipped gradients; other schemes reject the field before
    #: spawning rather than run without it
    supports_clip_grad: ClassVar[bool] = False
    #: trains on masked targets (``loss_mask > 0``) with the loss normalised by the global
    #: batch's counted tokens; other schemes reject the field before spawning
    supports_loss_mask: ClassVar[bool] = False
    #: trains a packed model (``pack_docs > 0``: attention within documents, positions
    #: restarted; ``parbench.model.packing``); other schemes reject the field before spawning
    supports_packing: ClassVar[bool] = False
    #: runs uneven end ranks of the pipeline (``Layout.first_stage_layers`` /
    #: ``last_stage_layers``, Megatron-Core's split) -- the native pipeline schemes
    supports_uneven_stages: ClassVar[bool] = False
    #: the LLaMA-style model features it runs (``ModelConfig.features``: rope, gqa, swiglu,
    #: rmsnorm, no-bias); a case using another is rejected before spawning
    model_features: ClassVar[frozenset] = frozenset()
    #: fields set on every case of its family's default set (``parbench verify scheme=...``
    #: with no case field; ``parbench.testing.defaults``): the degrees and shape its layout
    #: needs where the family's own cases (tp = 2, ...) cannot run it -- a q x q grid's tp = 4
    default_fields: ClassVar[dict] = {}
    #: the DeepSeek-style MoE features it runs (``ModelConfig.moe_features``: fine-grained,
    #: shared-expert, first-dense, sigmoid-router, expert-bias, group-limited); a case using
    #: another is rejected before spawning
    moe_features: ClassVar[frozenset] = frozenset()

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
        for axis, n in case.layout.degrees().items():
            if axis != "dp" and axis not in cls.uses and n != 1:
                raise ConfigError(f"{axis}={n} is not used by scheme {cls.name} (it uses "
                                  f"{', '.join(cls.uses)}); set {axis}=1")
        if case.model.num_experts and not cls.supports_moe:
            raise ConfigError(f"num_experts={case.model.num_experts}: scheme {cls.name} runs "
                              "dense models (MoE: expert.alltoall, hybrid)")
        if case.run.clip_grad and not cls.supports_clip_grad:
            raise ConfigError(f"clip_grad={case.run.clip_grad:g}: scheme {cls.name} does not "
                              "clip gradients by global norm (set clip_grad=0)")
        if case.run.loss_mask and not cls.supports_loss_mask:
            raise ConfigError(f"loss_mask={case.run.loss_mask:g}: scheme {cls.name} does not "
                              "normalise a masked loss by the global token count "
                              "(set loss_mask=0)")
        cls.check_model_features(case)
        cls.check_moe_features(case)
        opt = case.options
        if opt.recompute == "selective" and opt.recompute_modules != "core_attn":
            raise ConfigError(f"recompute_modules={opt.recompute_modules}: run recomputes the "
                              "attention core only (recompute_modules=core_attn, Megatron's "
                              "default); estimate counts and prices the others")
        if case.model.pack_docs and not cls.supports_packing:
            raise ConfigError(f"pack_docs={case.model.pack_docs}: scheme {cls.name} does not "
                              "attend within packed documents (set pack_docs=0)")
        if case.layout.uneven and not cls.supports_uneven_stages:
            raise ConfigError(f"first_stage_layers={case.layout.first_stage_layers}, "
                              f"last_stage_layers={case.layout.last_stage_layers}: scheme "
                              f"{cls.name} splits the layers evenly over its stages (set "
                              "both to 0)")

    @classmethod
    def check_model_features(cls, case: CaseConfig) -> None:
        """Refuse a LLaMA-style feature of the model this scheme does not declare."""
        missing = [f for name, f in case.model.features().items()
                   if name not in cls.model_features]
        if missing:
            runs = ", ".join(sorted(cls.model_features)) or "none: GPT-2 blocks only"
            raise ConfigError(f"{missing[0]}: scheme {cls.name} does not run this LLaMA-style "
                              f"feature (it runs: {runs})")

    @classmethod
    def check_moe_features(cls, case: CaseConfig) -> None:
        """Refuse a DeepSeek- or Mixtral-style MoE feature of the model this scheme does not
        declare."""
        missing = [(name, f) for name, f in case.model.moe_features().items()
                   if name not in cls.moe_features]
        if missing:
            runs = ", ".join(sorted(cls.moe_features)) or "none"
            name, field = missing[0]
            kind = "Mixtral-style" if name == "llama-experts" else "DeepSeek-style"
            raise ConfigError(f"{field}: scheme {cls.name} does not run this {kind} MoE "
                              f"feature (it runs: {runs}; the native expert family runs "
                              "them all)")

    @classmethod
    def routing_groups(cls, case: CaseConfig) -> RoutingGroups:
        """The MoE routing groups of this scheme, as the golden run must cut the batch: by
        default one group per rank and micro-batch (``parbench.model.moe``)."""
        return RoutingGroups(rows=case.layout.micro_batch_size)

    #: a framework baseline's disagreement with the golden run already reported (what it is
    #: and the reproducer that shows it): its rows still run and are compared; when they are
    #: not equivalent they are labelled FINDING and leave ``run``'s exit status alone (a
    #: row that passes says the framework no longer reproduces it). None for native schemes.
    known_finding: ClassVar[str | None] = None

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
    def reference(cls, case: CaseConfig, steps: int) -> GoldenRun:
        """The golden run this scheme must equal (default: single-device synchronous, routing
        this scheme's groups)."""
        return reference_run(case, steps, cls.routing_groups(case))

    def state_tensors(self) -> dict[str, list[torch.Tensor]] | None:
        """The tensors this rank keeps between steps, by category (``params``, ``grads``,
        ``optimizer``, ``other``), each storage counted once. The memory tracker walks
        everything reachable from the scheme object either way
        (``parbench.memory.live_model_states``): what is listed here is attributed to the
        category named, every other reachable storage as the tracker finds it. None (the
        default): nothing listed."""
        return None

    def full_state(self) -> dict[str, torch.Tensor]:
        """The model state beside the parameters this rank holds, unsharded, by the reference
        model's names: the MoE routers' balancing biases (``blocks.{i}.mlp.router.
        expert_bias``, ``parbench.model.router``), which the verdict holds to the golden
        model's update after every step. Default: none."""
        return {}

    def module_probes(self) -> list[ModuleProbe] | None:
        """This rank's modules that compute modules of the reference model, and on which part
        of the global batch (``parbench.probes``): when a case fails, the verdict reruns its
        checked steps with them to name the first module whose forward output or input
        gradient diverges from the golden run. None (the default): not mapped."""
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
        t = torch.tensor([float(value)], dtype=torch.float64)
        with comm.unrecorded():
            dist.all_reduce(t, group=group)
        return float(t.item())


# ---- the table of registered schemes ------------------------------------------------------

#: every scheme registered in this process, by name (``register`` fills it as modules are
#: imported; ``parbench.registry`` finds and imports them)
SCHEMES: dict[str, type[Scheme]] = {}


def register(cls: type[Scheme]) -> type[Scheme]:
    """Class decorator: make ``cls`` available by its ``name``."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    check_declared_options(cls)
    SCHEMES[cls.name] = cls
    return cls


def registered(name: str) -> type[Scheme]:
    """The scheme registered as ``name`` in this process: how a baseline finds the native
    scheme it is compared with (``baseline_of``), loaded with it by ``parbench.registry``."""
    if name not in SCHEMES:
        raise ConfigError(f"scheme={name!r} is not registered in this process (load it with "
                          "parbench.registry.get_scheme)")
    return SCHEMES[name]


def check_declared_options(cls: type[Scheme]) -> None:
    """Every option a scheme declares is a real field (a typo is an error at import)."""
    known = set(option_names()) | set(OPTIONAL_FIELDS)
    unknown = [n for n in cls.options if n not in known]
    if unknown:
        raise ValueError(f"{cls.__name__}.options names {', '.join(unknown)}: not an option "
                         f"(options: {', '.join(sorted(known))})")


def _check_scheme_class(cls, where: str) -> None:
    """``cls`` keeps the contract: a concrete subclass of ``Scheme`` with a family."""
    if not (isinstance(cls, type) and issubclass(cls, Scheme)):
        raise ConfigError(f"{where} is {cls!r}, not a subclass of parbench.Scheme")
    if getattr(cls, "__abstractmethods__", None):
        raise ConfigError(f"{where} does not implement "
                          f"{', '.join(sorted(cls.__abstractmethods__))}")
    if not cls.family:
        raise ConfigError(f"{where} declares no family (set family = 'data', 'pipeline', "
                          "'tensor', 'context', 'expert' or 'hybrid')")
