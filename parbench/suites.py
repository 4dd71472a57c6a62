"""Suites: YAML files of cases, expanded into CaseConfigs (``runner`` runs them).

A suite file has ``name``, ``description``, ``defaults`` (overrides for every case), an
optional ``grid`` (cartesian product of overrides) and an optional ``cases`` list. Overrides
use the command line's ``key=value`` keys. Command-line overrides apply last, to every case.
"""
from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .config import CaseConfig, ConfigError, validate_case
from .overrides import apply_overrides

SUITE_DIR = Path(__file__).resolve().parents[1] / "suites"


def suite_dirs() -> list[Path]:
    """The checkout's suites/ (an editable install keeps it beside the package), then
    ./suites of the working directory (a user's own suites win on a name clash)."""
    dirs = [SUITE_DIR, Path.cwd() / "suites"]
    return [d for d in dirs if d.is_dir()]


def available_suites() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for d in reversed(suite_dirs()):
        for p in sorted(d.glob("*.yaml")):
            out[p.stem] = p
    return dict(sorted(out.items()))


@dataclass
class Suite:
    name: str
    description: str
    cases: list[CaseConfig] = field(default_factory=list)


def case_id(case: CaseConfig) -> str:
    d = case.to_dict()
    d.pop("id", None)
    digest = hashlib.sha1(json.dumps(d, sort_keys=True).encode()).hexdigest()[:8]
    return f"{case.run.scheme}:{case.layout.label()}:{digest}"


def load_suite(name: str, overrides: dict | None = None) -> Suite:
    suites = available_suites()
    path = Path(name) if name.endswith((".yaml", ".yml")) else suites.get(name)
    if path is None or not path.exists():
        raise ConfigError(f"suite={name!r} does not exist (choose from {', '.join(suites)})")
    with open(path) as fh:
        spec = yaml.safe_load(fh) or {}
    return expand(spec, overrides or {}, default_name=path.stem)


def _as_overrides(d: dict) -> dict[str, str]:
    return {str(k): (str(v).lower() if isinstance(v, bool) else str(v)) for k, v in d.items()}


def expand(spec: dict, overrides: dict, default_name: str = "suite") -> Suite:
    defaults = _as_overrides(spec.get("defaults") or {})
    rows: list[dict] = []
    grid = spec.get("grid") or {}
    if grid:
        keys = list(grid)
        for combo in itertools.product(*(grid[k] if isinstance(grid[k], list) else [grid[k]]
                                         for k in keys)):
            rows.append(dict(zip(keys, combo)))
    rows.extend(spec.get("cases") or [])
    if not rows:
        rows = [{}]
    cases = []
    seen = set()
    for row in rows:
        merged = dict(defaults)
        merged.update(_as_overrides(row))
        merged.update(_as_overrides(overrides))
        # a preset chosen by the row or the command line is applied before field overrides
        case = apply_overrides(CaseConfig(), merged)
        case.id = case_id(case)
        if case.id in seen:
            continue
        seen.add(case.id)
        cases.append(case)
    return Suite(name=spec.get("name", default_name), description=spec.get("description", ""),
                 cases=cases)


def check_suite(suite: Suite, world_size: int | None = None) -> None:
    """Every check that can run before spawning: config rules, scheme exists, scheme rules."""
    from .registry import get_scheme  # loads impls/ (torch): reading a suite stays light
    for case in suite.cases:
        validate_case(case, world_size)
        cls = get_scheme(case.run.scheme)
        if cls.unavailable() is None:  # else ``run`` skips it, saying why
            cls.check(case)
