"""Finding schemes by name: the native ones under ``impls/``, those installed packages declare
in the entry-point group ``parbench.schemes``, a user's class named ``pkg.module:Class`` or
``path/to/file.py:Class``, and the self-test's mutants (``mutant.<id>``).

The contract and the table of registered schemes live a floor below, in ``parbench.scheme``;
this module stands above ``impls/``: it imports every module there (each registers its
schemes on import), once per process, when a scheme is first asked for.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import pkgutil
import sys
from pathlib import Path

import impls

from . import scheme as contract
from .config import CaseConfig, ConfigError
from .model.moe import RoutingGroups
from .scheme import Scheme, _check_scheme_class
from .selftest import catalogue

#: entry points of the group ``parbench.schemes`` that failed to load: name -> why
_BROKEN_ENTRY_POINTS: dict[str, str] = {}
ENTRY_POINT_GROUP = "parbench.schemes"
_LOADED = False


def _load_all() -> None:
    """Import every module under ``impls/`` (each registers its schemes on import), then the
    schemes installed packages declare in the entry-point group ``parbench.schemes``
    (``name = "pkg.module:Class"``; registered under the entry point's name)."""
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    for mod in pkgutil.walk_packages(impls.__path__, prefix="impls."):
        importlib.import_module(mod.name)
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            cls = ep.load()
            _check_scheme_class(cls, f"entry point {ep.name} = {ep.value}")
        except Exception as e:  # noqa: BLE001 -- reported when the scheme is asked for
            _BROKEN_ENTRY_POINTS[ep.name] = f"{type(e).__name__}: {e}"
            continue
        contract.SCHEMES.setdefault(ep.name, cls)


def is_external(name: str) -> bool:
    """``pkg.module:Class`` or ``path/to/file.py:Class``: a scheme loaded by its path."""
    return ":" in name


def _import_module(target: str, spec: str):
    """The module of ``target`` (a dotted name, or a .py file path)."""
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


def _user_module(target: str, spec: str):
    """``_import_module``, every failure one ConfigError naming what failed."""
    try:
        return _import_module(target, spec)
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


def load_external(spec: str) -> type[Scheme]:
    """A user's scheme class named ``pkg.module:Class`` or ``path/to/file.py:Class``,
    imported and registered under ``spec`` (every rank process resolves the same string).
    Bad input is one ConfigError naming what failed."""
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        raise ConfigError(f"scheme={spec!r} must be pkg.module:Class or path/to/file.py:Class")
    obj = _user_module(target, spec)
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"scheme={spec!r}: {target!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    _check_scheme_class(obj, f"scheme={spec!r}")
    contract.SCHEMES[spec] = obj
    return obj


def get_scheme(name: str) -> type[Scheme]:
    """The scheme registered as ``name``, found (and imported) first if need be."""
    _load_all()
    schemes = contract.SCHEMES
    if name.startswith("mutant.") and name not in schemes:
        catalogue.load()
    if name not in schemes and is_external(name):
        return load_external(name)
    if name in _BROKEN_ENTRY_POINTS and name not in schemes:
        raise ConfigError(f"scheme={name!r}: its entry point ({ENTRY_POINT_GROUP}) failed to "
                          f"load: {_BROKEN_ENTRY_POINTS[name]}")
    if name not in schemes:
        raise ConfigError(f"scheme={name!r} is not registered (choose from "
                          f"{', '.join(sorted(schemes))}, or give pkg.module:Class)")
    return schemes[name]


def all_schemes() -> dict[str, type[Scheme]]:
    """Every registered scheme of parbench and its entry points: not the self-test's mutants,
    nor a user's scheme loaded from a file (``FILE:Class``) earlier in this process."""
    _load_all()
    return dict(sorted((n, c) for n, c in contract.SCHEMES.items()
                       if not n.startswith("mutant.") and ":" not in n))


def routing_of(case: CaseConfig) -> RoutingGroups:
    """The MoE routing groups the scheme of ``case`` routes (what its golden run routes)."""
    return get_scheme(case.run.scheme).routing_groups(case)
