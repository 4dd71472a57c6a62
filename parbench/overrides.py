"""The one ``key=value`` coercer: every verb (run, estimate, traffic, schedule, mesh) uses it.

``parse_overrides`` splits ``key=value`` arguments; ``coerce`` turns one value into the
field's type with a one-line error naming the key, the value and the rule (nan and inf are
never numbers here); ``apply_overrides`` applies dotted (``parallel.pp=4``) or bare (``pp=4``)
keys to a ``CaseConfig``, a preset first (``model=tiny``).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import fields
from typing import Any

from .config import (SECTIONS, CaseConfig, ConfigError, ModelConfig, ParallelConfig,
                     RunConfig, model_preset)

_TYPES = {"int": int, "float": float, "bool": bool, "str": str}


def coerce(value: Any, target_type: Any, key: str) -> Any:
    """``value`` as ``target_type`` (int, float, bool, str or their names)."""
    t = target_type if isinstance(target_type, type) else _TYPES.get(str(target_type), str)
    if t is bool:
        if isinstance(value, bool):
            return value
        low = str(value).lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{key}={value!r} is not a boolean (use true/false)")
    if t is int:
        f = _finite(value, key, "an integer")
        if f != int(f):
            raise ConfigError(f"{key}={value!r} is not an integer")
        return int(f)
    if t is float:
        return _finite(value, key, "a number")
    return str(value)


def _finite(value: Any, key: str, what: str) -> float:
    try:
        f = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}={value!r} is not {what}") from None
    if not math.isfinite(f):
        raise ConfigError(f"{key}={value!r} is not {what} (must be finite)")
    return f


def number(key: str, value: Any, integer: bool = False, minimum: float | None = None,
           strict: bool = False) -> int | float:
    """A numeric argument of a verb, with an optional lower bound (``strict``: > minimum)."""
    v = coerce(value, int if integer else float, key)
    if minimum is not None and (v <= minimum if strict else v < minimum):
        rule = f"> {minimum:g}" if strict else f">= {minimum:g}"
        raise ConfigError(f"{key}={value} must be {rule}")
    return v


def parse_overrides(args: list[str]) -> dict[str, str]:
    """``["a=1", "parallel.pp=2"]`` -> ``{"a": "1", "parallel.pp": "2"}``."""
    out: dict[str, str] = {}
    for a in args:
        if "=" not in a:
            raise ConfigError(f"argument {a!r} is not of the form key=value")
        k, v = a.split("=", 1)
        if not k.strip():
            raise ConfigError(f"argument {a!r} has an empty key")
        out[k.strip()] = v.strip()
    return out


def field_types(obj) -> dict[str, Any]:
    return {f.name: f.type for f in fields(obj)}


#: short names Megatron / DeepSpeed users type: ``zero=1`` is ``zero_stage=1``
ALIASES = {"zero": "zero_stage"}


def resolve_key(key: str) -> tuple[str, str]:
    """(section, field) of a dotted or bare key; unknown keys raise ConfigError."""
    types = {s: field_types(cls) for s, cls in zip(SECTIONS, (ModelConfig, ParallelConfig,
                                                                RunConfig))}
    if "." in key:
        sec, name = key.split(".", 1)
        if sec not in SECTIONS:
            raise ConfigError(f"unknown key {key!r}: section {sec!r} is not one of "
                              f"{', '.join(SECTIONS)}")
        if name not in types[sec]:
            raise ConfigError(f"unknown key {key!r}: {sec} has no field {name!r}")
        return sec, name
    key = ALIASES.get(key, key)
    hits = [s for s in SECTIONS if key in types[s]]
    if not hits:
        raise ConfigError(f"unknown key {key!r} (see `parbench list` for the fields)")
    return hits[0], key


def apply_overrides(case: CaseConfig, overrides: dict[str, Any]) -> CaseConfig:
    """Return a copy of ``case`` with ``key=value`` overrides applied.

    ``model=PRESET`` selects a preset first; dotted keys name a section; bare keys are
    looked up in model, parallel, run (in that order).
    """
    sections = {s: dataclasses.asdict(getattr(case, s)) for s in SECTIONS}
    types = {s: field_types(getattr(case, s)) for s in SECTIONS}
    ov = dict(overrides)
    preset = ov.pop("model", None)
    if preset is not None:
        sections["model"] = dataclasses.asdict(model_preset(str(preset)))
    for key, value in ov.items():
        sec, name = resolve_key(key)
        sections[sec][name] = coerce(value, types[sec][name], key)
    return CaseConfig(model=ModelConfig(**sections["model"]),
                      parallel=ParallelConfig(**sections["parallel"]),
                      run=RunConfig(**sections["run"]), id=case.id)
