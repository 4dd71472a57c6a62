"""The options of each family of schemes, beside the :class:`~parbench.layout.Layout`.

One frozen dataclass per family (tensor, context, pipeline, expert, data) and one record,
:class:`Options`, holding them with the one option every family reads (activation
recomputation). A scheme declares the fields it reads (``Scheme.options``); an option given
on the command line that no case's scheme reads is an error (``parbench run``).

Every field states its rule in its metadata -- a lower bound or the values it accepts -- and
``__post_init__`` checks it, so a bad option fails where it is built, with one message that
names the field, the value and the rule. This module is pure (no torch, no other parbench
module but :mod:`.layout`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any

from .layout import ConfigError

RECOMPUTE = ("none", "selective", "full")
#: the submodules selective recomputation may recompute, as Megatron-Core names them
#: (``TransformerConfig.recompute_modules``, megatron-core 0.16): the attention core, the
#: MoE experts' activation function, the two norms, MLA's up projections and RoPE, the dense
#: MLP, the whole MoE layer, the shared experts. Megatron's default is ``core_attn`` alone
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe",
                     "shared_experts")
#: context-parallel attention algorithms (the names of ``parbench.analytic.context``)
CP_ALGORITHMS = ("ring-attention", "ulysses", "allgather", "usp", "ring-self-attention")
CP_BALANCE = ("none", "zigzag", "striped")


def choice(default: str, values: tuple[str, ...], help: str = ""):
    """A string field that accepts one of ``values``."""
    return field(default=default, metadata={"choices": values, "help": help})


def bounded(default: Any, low: float, help: str = "", strict: bool = False,
            infinite: bool = False):
    """A numeric field with a lower bound (``strict``: above it; ``infinite``: ``inf`` is
    allowed too)."""
    return field(default=default, metadata={"min": low, "strict": strict, "help": help,
                                            "infinite": infinite})


def check_fields(obj: Any) -> None:
    """Every field's own rule (its ``choices`` or its lower bound; numbers finite)."""
    for f in fields(obj):
        v, meta = getattr(obj, f.name), f.metadata
        if "choices" in meta and v not in meta["choices"]:
            allowed = ", ".join(str(c) for c in meta["choices"])
            raise ConfigError(f"{f.name}={v!r} must be one of {allowed}")
        if "min" in meta:
            low, strict = meta["min"], meta["strict"]
            if meta["infinite"] and v == math.inf:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ConfigError(f"{f.name}={v!r} must be a finite number")
            if v < low or (strict and v == low):
                raise ConfigError(f"{f.name}={v} must be {'>' if strict else '>='} {low:g}")


@dataclass(frozen=True)
class TensorOptions:
    """Megatron sequence parallelism (Korthikanti et al. 2022) and the depth of 2.5-D
    tensor parallelism (Tesseract: a q x q x d grid, tp = q^2 d)."""

    sp: bool = False
    tp_depth: int = bounded(1, 1, "2.5-D tensor parallelism: d of the q x q x d grid")

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class ContextOptions:
    """Context parallelism: which attention algorithm (the hybrid's and the time model's),
    ring attention's load balancing, USP's Ulysses degree, LoongTrain's inner ring."""

    cp_algorithm: str = choice("ring-attention", CP_ALGORITHMS,
                               "context-parallel attention (hybrid, estimate, plan)")
    cp_balance: str = choice("zigzag", CP_BALANCE, "ring attention's load balancing")
    cp_ulysses: int = bounded(1, 1, "USP: the Ulysses degree of the cp grid")
    cp_window: int = bounded(1, 1, "LoongTrain: inner ring size of the double ring")

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class PipelineOptions:
    """Token slices per sequence (Seq1F1B, TeraPipe) and TeraPipe's slicing rule."""

    seq_segments: int = bounded(1, 1, "token slices per sequence (Seq1F1B, TeraPipe)")
    terapipe_slicing: str = choice("uniform", ("uniform", "dp"),
                                   "TeraPipe: uniform slices or its dynamic programme")

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class ExpertOptions:
    """Tutel's expert placement and dispatch, FasterMoE's shadowed experts."""

    moe_mode: str = choice("ep", ("ep", "dp", "adaptive"),
                           "Tutel: where an MoE layer's experts run")
    moe_a2a: str = choice("flat", ("flat", "2d"), "Tutel: flat or hierarchical all-to-all")
    moe_shadow: int = bounded(0, 0, "FasterMoE: shadowed popular experts, 0 = none")

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class DataOptions:
    """Data parallelism: ZeRO stage (Rajbhandari et al. 2020), gradient buckets, local
    SGD's period, and whether the gradient reduction overlaps the backward."""

    zero_stage: int = choice(0, (0, 1, 2, 3), "ZeRO stage 0-3")
    bucket_mb: float = bounded(0.25, 0, "DDP/ZeRO gradient bucket size in MiB (inf: one "
                               "flat buffer)", strict=True, infinite=True)
    local_sgd_period: int = bounded(2, 1, "H: average every H steps (local SGD)")
    overlap_grad_reduce: bool = True

    def __post_init__(self) -> None:
        check_fields(self)


#: family -> its option dataclass (the dotted key's section: ``context.cp_balance=none``)
FAMILY_OPTIONS: dict[str, type] = {"tensor": TensorOptions, "context": ContextOptions,
                                   "pipeline": PipelineOptions, "expert": ExpertOptions,
                                   "data": DataOptions}


@dataclass(frozen=True)
class Options:
    """Every family's options, and activation recomputation (Korthikanti et al. 2022: none;
    selective, the attention core; full, every layer from its input)."""

    tensor: TensorOptions = field(default_factory=TensorOptions)
    context: ContextOptions = field(default_factory=ContextOptions)
    pipeline: PipelineOptions = field(default_factory=PipelineOptions)
    expert: ExpertOptions = field(default_factory=ExpertOptions)
    data: DataOptions = field(default_factory=DataOptions)
    recompute: str = choice("none", RECOMPUTE, "activation recomputation")
    #: what ``recompute=selective`` recomputes: comma-separated names of
    #: :data:`RECOMPUTE_MODULES` (Megatron's ``--recompute-modules``), kept in that order
    recompute_modules: str = field(default="core_attn", metadata={
        "help": "the submodules selective recomputation recomputes (comma-separated: "
                + ", ".join(RECOMPUTE_MODULES) + ")"})

    def __post_init__(self) -> None:
        if self.recompute not in RECOMPUTE:
            raise ConfigError(f"recompute={self.recompute!r} must be one of "
                              f"{', '.join(RECOMPUTE)}")
        object.__setattr__(self, "recompute_modules", canonical_modules(self.recompute_modules))

    @property
    def selective_modules(self) -> frozenset[str]:
        """The submodules ``recompute=selective`` recomputes (``recompute_modules``)."""
        return frozenset(self.recompute_modules.split(","))

    @classmethod
    def from_dict(cls, d: dict | None) -> "Options":
        """From ``dataclasses.asdict`` output (a case file, a row's case)."""
        d = d or {}
        parts = {fam: kind(**d.get(fam, {})) for fam, kind in FAMILY_OPTIONS.items()}
        return cls(**parts, recompute=d.get("recompute", "none"),
                   recompute_modules=d.get("recompute_modules", "core_attn"))

    def with_values(self, **values: Any) -> "Options":
        """A copy with bare option names changed: ``with_values(sp=True, zero_stage=1)``."""
        changes: dict[str, dict] = {}
        for name, v in values.items():
            changes.setdefault(option_family(name) or "", {})[name] = v
        parts = {fam: replace(getattr(self, fam), **kw) for fam, kw in changes.items() if fam}
        return replace(self, **parts, **changes.get("", {}))


def canonical_modules(text: str) -> str:
    """``recompute_modules`` checked (every name one of :data:`RECOMPUTE_MODULES`, at least
    one) and written in :data:`RECOMPUTE_MODULES`' order. Read only with
    ``recompute=selective``, as Megatron reads ``--recompute-modules`` only with
    ``--recompute-granularity selective``."""
    names = [n.strip() for n in str(text).replace(" ", ",").split(",") if n.strip()]
    bad = [n for n in names if n not in RECOMPUTE_MODULES]
    if bad or not names:
        raise ConfigError(f"recompute_modules={text!r} must name one or more of "
                          f"{', '.join(RECOMPUTE_MODULES)} (comma-separated)")
    return ",".join(m for m in RECOMPUTE_MODULES if m in names)


def option_family(name: str) -> str | None:
    """The family whose options hold the bare field ``name`` (None: ``recompute``, a field
    of :class:`Options` itself); unknown names raise ConfigError."""
    for fam, kind in FAMILY_OPTIONS.items():
        if name in {f.name for f in fields(kind)}:
            return fam
    if name in ("recompute", "recompute_modules"):
        return None
    raise ConfigError(f"{name!r} is not an option (options: {', '.join(option_names())})")


def option_names() -> list[str]:
    """Every bare option name, family by family, then ``recompute``."""
    out = [f.name for kind in FAMILY_OPTIONS.values() for f in fields(kind)]
    return out + ["recompute", "recompute_modules"]
