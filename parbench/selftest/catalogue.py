"""The mutation catalogue: realistic bugs in native schemes that the verdict must catch.

A mutant is a subclass of a native scheme with one method changed (a real code change, not a
flag in the comparer), registered under ``mutant.<id>`` so that the ranks build it by name as
they build any scheme. ``mutant(...)`` records what it breaks and the case that exposes it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..scheme import register


@dataclass(frozen=True)
class Mutant:
    id: str
    base: str  # the native scheme it breaks
    bug: str
    #: case fields the bug needs to show (e.g. num_microbatches=2 for an accumulation bug)
    overrides: dict = field(default_factory=dict)

    @property
    def scheme(self) -> str:
        return f"mutant.{self.id}"


CATALOGUE: dict[str, Mutant] = {}


def mutant(id: str, *, base: str, bug: str, overrides: dict | None = None):
    """Class decorator: register the subclass as scheme ``mutant.<id>``."""
    def wrap(cls):
        m = Mutant(id, base, bug, dict(overrides or {}))
        cls.name = m.scheme
        cls.description = f"mutant of {base}: {bug}"
        register(cls)
        CATALOGUE[id] = m
        return cls
    return wrap


def load() -> dict[str, Mutant]:
    """Import every ``mutants_*`` module of this package (each registers its mutants)."""
    import importlib
    import pkgutil
    from pathlib import Path
    for mod in sorted(pkgutil.iter_modules([str(Path(__file__).parent)]), key=lambda m: m.name):
        if mod.name.startswith("mutants_"):
            importlib.import_module(f"{__package__}.{mod.name}")
    return CATALOGUE


def with_model(scheme_cls, model_cls):
    """``scheme_cls`` building ``model_cls`` (a subclass of its model) instead: how a mutant
    swaps a scheme's model for a broken one."""
    return type(scheme_cls.__name__, (scheme_cls,), {"model_cls": model_cls})
