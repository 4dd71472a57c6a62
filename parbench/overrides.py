"""The one ``key=value`` coercer: every verb (run, estimate, traffic, schedule, mesh) uses it.

``parse_overrides`` splits ``key=value`` arguments; ``coerce`` turns one value into the
field's type with a one-line error naming the key, the value and the rule (nan and inf are
never numbers here); ``apply_overrides`` applies dotted (``parallel.pp=4``) or bare (``pp=4``)
keys to a ``CaseConfig``, a preset first (``model=tiny``). ``field_table`` is the one table of
settable fields: it resolves keys here and prints each verb's ``--help``.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, fields
from typing import Any

from .config import RULES, CaseConfig, ConfigError, ModelConfig, RunConfig, model_preset
from .layout import Layout
from .options import FAMILY_OPTIONS, Options

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


@dataclass(frozen=True)
class FieldInfo:
    """One settable field: its bare name, its section, its type, default, rule and help."""

    name: str
    section: str
    type: Any
    default: Any
    rule: str
    help: str


#: the sections of a case, in the order ``--help`` lists them; a dotted key names one
#: (``layout.pp=4``, ``context.cp_balance=none``); ``parallel.`` is the old name of the
#: layout and the options together and is still read
SECTIONS = ("model", "layout", *FAMILY_OPTIONS, "options", "run")


def _section_classes() -> dict[str, type]:
    return {"model": ModelConfig, "layout": Layout, **FAMILY_OPTIONS, "options": Options,
            "run": RunConfig}


def _rule_text(f) -> str:
    meta = f.metadata
    if "choices" in meta:
        return "one of " + ", ".join(str(c) for c in meta["choices"])
    if "min" in meta:
        return f"{'>' if meta['strict'] else '>='} {meta['min']:g}"
    if "rule" in meta:
        return RULES[meta["rule"]][1].replace("must be ", "")
    return ""


def field_table() -> dict[str, FieldInfo]:
    """Every settable field by bare name (bare names are unique across sections): what
    ``key=value`` resolves, validates and what ``VERB --help`` prints."""
    out: dict[str, FieldInfo] = {}
    for sec, cls in _section_classes().items():
        for f in fields(cls):
            if sec == "options" and f.name in FAMILY_OPTIONS:
                continue  # the nested family records, listed as their own sections
            default = f.default if f.default is not dataclasses.MISSING else None
            assert f.name not in out, f"field {f.name} in two sections"
            out[f.name] = FieldInfo(f.name, sec, f.type, default, _rule_text(f),
                                    f.metadata.get("help", ""))
    return out


#: short names Megatron / DeepSpeed users type: ``zero=1`` is ``zero_stage=1``
ALIASES = {"zero": "zero_stage"}


def resolve_key(key: str) -> FieldInfo:
    """The field of a dotted or bare key; unknown keys raise ConfigError."""
    table = field_table()
    if "." in key:
        sec, name = key.split(".", 1)
        if sec not in SECTIONS and sec != "parallel":
            raise ConfigError(f"unknown key {key!r}: section {sec!r} is not one of "
                              f"{', '.join(SECTIONS)}")
        info = table.get(ALIASES.get(name, name))
        legacy = sec == "parallel" and info is not None and info.section not in \
            ("model", "run")
        if info is None or (info.section != sec and not legacy):
            raise ConfigError(f"unknown key {key!r}: {sec} has no field {name!r}")
        return info
    info = table.get(ALIASES.get(key, key))
    if info is None:
        raise ConfigError(f"unknown key {key!r} (see `parbench run --help` for the fields)")
    return info


def apply_overrides(case: CaseConfig, overrides: dict[str, Any]) -> CaseConfig:
    """Return a copy of ``case`` with ``key=value`` overrides applied.

    ``model=PRESET`` selects a preset first; dotted keys name a section; bare keys are
    unique across the sections.
    """
    plain = {s: dataclasses.asdict(getattr(case, s)) for s in ("model", "layout", "run")}
    ov = dict(overrides)
    preset = ov.pop("model", None)
    if preset is not None:
        plain["model"] = dataclasses.asdict(model_preset(str(preset)))
    options: dict[str, Any] = {}
    for key, value in ov.items():
        info = resolve_key(key)
        v = coerce(value, info.type, key)
        if info.section in plain:
            plain[info.section][info.name] = v
        else:
            options[info.name] = v
    return CaseConfig(model=ModelConfig(**plain["model"]), layout=Layout(**plain["layout"]),
                      options=case.options.with_values(**options),
                      run=RunConfig(**plain["run"]), id=case.id)
