"""The helpers of ``parbench.testing``: a case and a scheme named, a case run on the pool's
ranks (``run_scheme``), and the assertions (``assert_equivalent``, ``assert_bytes``) with their
exceptions. Their messages are built in ``reports``."""
from __future__ import annotations

import importlib
import inspect
import sys
import weakref
from dataclasses import dataclass
from typing import Any

from ..config import CaseConfig, ConfigError
from ..results import FirstFailure
from .reports import _describe, _failed_check, _figure_diffs, bytes_report, equivalence_report

class NotEquivalent(AssertionError):
    """The scheme's losses, gradients, parameters or update differ from the golden run."""


class BytesDiffer(AssertionError):
    """The scheme's measured traffic (bytes, calls, model states) differs from the
    prediction."""


class SchemeCrashed(AssertionError):
    """A rank raised, died or hung: the message carries its traceback (hangs: every rank's
    stack and the collective each rank waits in)."""


#: what a case is when a helper is given no fields for it: the smallest model, no timed steps
DEFAULTS = {"model": "tiny", "timed_steps": 0}


# ---- the scheme and the case ------------------------------------------------------------------


def scheme_spec(scheme) -> str:
    """The string every rank resolves the scheme by: a spec string as given; a class's
    registered name for parbench's own schemes; ``"pkg.module:Class"`` for any other class
    (``"/path/file.py:Class"`` for one defined in a script run as ``__main__`` or loaded from
    a file path)."""
    if isinstance(scheme, str):
        return scheme
    from ..scheme import Scheme
    from ..registry import get_scheme
    if not (isinstance(scheme, type) and issubclass(scheme, Scheme)):
        raise TypeError(f"{scheme!r} is neither a parbench.Scheme subclass nor a "
                        "'pkg.module:Class' string")
    module, qualname = scheme.__module__, scheme.__qualname__
    if module.split(".")[0] in ("impls", "parbench") and scheme.name:
        try:
            if get_scheme(scheme.name) is scheme:
                return scheme.name
        except ConfigError:
            pass
    if "<locals>" in qualname:
        raise TypeError(f"{qualname} is defined inside a function; the ranks import a scheme "
                        "by its module path, so define it at a module's top level")
    if module == "__main__" or module.startswith("parbench_user_"):
        # a script run as __main__, or a file loaded by its path (get_scheme("f.py:Cls")):
        # the ranks load the same file by its path
        path = inspect.getsourcefile(scheme)
        if not path:
            raise TypeError(f"{qualname} is defined in {module} without a source file; "
                            "move it to a module")
        from pathlib import Path
        return f"{Path(path).resolve()}:{qualname}"
    return f"{module}:{qualname}"


def _as_override(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def make_case(scheme=None, case: CaseConfig | None = None, **fields) -> CaseConfig:
    """A validated case: ``case`` (or the defaults: the tiny model, no timed steps) with
    ``fields`` applied as ``key=value`` overrides, run by ``scheme`` when given. Bad input is
    a ``ConfigError`` naming the field, the value and the rule (and, given a scheme, the
    scheme's ``check``)."""
    from ..overrides import apply_overrides
    from ..registry import get_scheme
    from ..suites import case_id
    from ..config import validate_case
    base = case if case is not None else CaseConfig()
    overrides = dict(fields) if case is not None else {**DEFAULTS, **fields}
    if scheme is not None:
        overrides["scheme"] = scheme_spec(scheme)
    out = apply_overrides(base, {k: _as_override(v) for k, v in overrides.items()})
    validate_case(out)
    if scheme is not None:
        get_scheme(out.run.scheme).check(out)
    out.id = case_id(out)
    return out


def _family_native(family: str) -> str | None:
    from .defaults import NATIVE
    return NATIVE.get(family)


def native_scheme(scheme) -> str:
    """The native scheme a scheme is compared with, as ``parbench verify`` picks it: its
    ``baseline_of``, else its family's native scheme (``data`` -> ``data.ddp``, ...)."""
    from ..registry import get_scheme
    cls = get_scheme(scheme_spec(scheme))
    name = cls.baseline_of or _family_native(cls.family)
    if not name:
        raise ConfigError(f"family={cls.family!r} of {scheme_spec(scheme)} has no native "
                          "scheme; set baseline_of or give expected=")
    return name


# ---- running on the pool -----------------------------------------------------------------------


@dataclass
class SchemeRun:
    """One case run on every rank: the case, the ranks merged (``parbench.verdict.Merged``)
    and each rank's ``RankResult``."""

    spec: str
    case: CaseConfig
    merged: Any
    per_rank: list

    @property
    def equivalent(self) -> bool:
        return bool(self.merged.equivalent)

    def first_failure(self) -> FirstFailure | None:
        """The earliest failing check (step, rank, what, tensor, max_abs, tolerance): as the
        verdict records it, else assembled from the per-step flags (no tensor name)."""
        recorded = getattr(self.merged, "first_failure", None)
        if recorded:
            return recorded
        for s in range(len(self.merged.losses)):
            for r in self.per_rank:
                what = _failed_check(r.checks[s])
                if what:
                    return what.at(s, r.rank)
        if self.merged.uncovered:
            return FirstFailure("uncovered", self.merged.uncovered[0],
                                detail=f"{len(self.merged.uncovered)} golden parameter(s) "
                                       "reported by no rank")
        return None


#: per pool, the sys.path its ranks were last given (spawned ranks copy the parent's at start)
_SYNCED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _extend_sys_path(wctx, paths: list[str]) -> None:
    """A pool task: the parent's import path, so a rank imports what the test process can."""
    missing = [p for p in paths if p not in sys.path]
    if missing:
        sys.path[:0] = missing
        importlib.invalidate_caches()


def _sync_sys_path(pool) -> None:
    paths = list(sys.path)
    if _SYNCED.get(pool) != tuple(paths):
        pool.run(_extend_sys_path, paths, timeout_s=60)
        _SYNCED[pool] = tuple(paths)


def _pool_for(case: CaseConfig, pool):
    """The pool to run ``case`` on: ``pool`` (a WorkerPool, or a getter such as the
    ``parbench_pool`` fixture), else the process-wide shared pool of its world size."""
    from ..launch import WorkerPool, shared_pool
    world = case.layout.world_size
    if pool is None:
        return shared_pool(world, device=case.run.device)
    if not isinstance(pool, WorkerPool) and callable(pool):
        pool = pool(world)
    if pool.world_size != world:
        raise ValueError(f"the pool has {pool.world_size} ranks; the case needs {world}")
    return pool


def run_scheme(scheme, *, case: CaseConfig | None = None, pool=None, **fields) -> SchemeRun:
    """Run ``scheme`` on one case on every rank (the session's pool; a fresh one for
    ``isolated`` schemes) and merge the ranks. Raises ``SchemeCrashed`` if a rank fails."""
    from ..launch import RankError
    from ..runner import run_per_rank
    from ..registry import get_scheme
    from ..verdict import merge_ranks
    c = make_case(scheme, case, **fields)
    spec = c.run.scheme
    cls = get_scheme(spec)
    the_pool = None if cls.isolated else _pool_for(c, pool)
    try:
        if the_pool is not None and ":" in spec:
            _sync_sys_path(the_pool)
        per_rank = run_per_rank(c, the_pool)
    except RankError as e:
        raise SchemeCrashed(f"{spec} {e.kind} on rank {e.rank} ({_describe(c)}):\n"
                            f"{e.traceback_text.rstrip()}") from None
    names = sorted(cls.reference(c, 1).params[0])
    return SchemeRun(spec, c, merge_ranks(per_rank, names), per_rank)


# ---- equivalence ------------------------------------------------------------------------------


def default_set(scheme) -> list[CaseConfig]:
    """The cases of ``scheme``'s family default set that it accepts (what ``parbench verify``
    runs with no case field; ``parbench.testing.defaults``). A scheme that accepts none is
    a ``ConfigError`` listing why each was left out."""
    from ..registry import get_scheme
    from .defaults import default_cases
    spec = scheme_spec(scheme)
    cls = get_scheme(spec)
    out, skipped = default_cases(cls, spec)
    if not out:
        raise ConfigError(f"scheme {spec} accepts none of the {cls.family} family's default "
                          "cases: " + "; ".join(skipped))
    return out


def assert_equivalent(scheme, *, case: CaseConfig | None = None, pool=None,
                      **fields) -> SchemeRun | list[SchemeRun]:
    """Run ``scheme`` on the case and assert it equals the golden run: every rank's loss and
    gradients against the stepwise golden, its optimizer update, its initial weights, every
    parameter covered. Raises ``NotEquivalent`` naming the first failing step, rank, check
    and tensor with the difference and the tolerance, and the losses beside the golden
    run's. Returns the ``SchemeRun`` (for further checks) when it passes.

    Given neither ``case`` nor a field, it runs every case of the family's default set
    (``default_set``: micro-batches, odd shapes, odd dp, tied embeddings, each declared
    option's values), stops at the first that is not equivalent, and returns the list of
    ``SchemeRun``s."""
    if case is None and not fields:
        return [assert_equivalent(scheme, case=c, pool=pool) for c in default_set(scheme)]
    result = run_scheme(scheme, case=case, pool=pool, **fields)
    if not result.equivalent:
        raise NotEquivalent(equivalence_report(result))
    return result


# ---- bytes ------------------------------------------------------------------------------------


def _prediction_for(cls, spec: str, case: CaseConfig, expected):
    """(prediction, where it comes from)."""
    from ..scheme import Prediction, Scheme
    from ..registry import get_scheme
    if isinstance(expected, Prediction):
        return expected, "the expected prediction"
    if expected is not None:
        name = scheme_spec(expected)
        other = get_scheme(name)
        return other.predict(case), f"{name}'s closed form"
    if cls.predict.__func__ is not Scheme.predict.__func__:
        pred = cls.predict(case)
        if pred is not None:
            return pred, f"{spec}.predict"
    name = native_scheme(spec)
    return get_scheme(name).predict(case), \
        f"{name}'s closed form ({spec} has no predict; {name} is its family's native scheme)"


def assert_bytes(scheme, expected=None, *, case: CaseConfig | None = None, pool=None,
                 calls: bool = True, states: bool = False, **fields) -> SchemeRun:
    """Run ``scheme`` on the case and assert that on every checked step each rank's measured
    wire bytes (and, with ``calls``, its byte-carrying calls; with ``states``, its model
    states) per mesh axis equal the prediction: ``expected`` (a ``Prediction``, or a scheme
    whose ``predict`` to use), else the scheme's own ``predict``, else that of the native
    scheme of its family. Raises ``BytesDiffer`` with a table of the differences."""
    from ..registry import get_scheme
    result = run_scheme(scheme, case=case, pool=pool, **fields)
    c = result.case
    if not c.run.instrument:
        raise ValueError("instrument=false: no traffic is recorded; run with instrument=true")
    pred, source = _prediction_for(get_scheme(result.spec), result.spec, c, expected)
    if pred is None or pred.wire_at(0) is None:
        raise ValueError(f"nothing to compare with: {source} predicts no bytes")
    m = result.merged
    kinds = [("bytes", m.wire_by_step, pred.wire_at, 0.5)]
    if calls and pred.calls_at(0) is not None:
        kinds.append(("calls", m.calls_by_step, pred.calls_at, 0))
    if states:
        if pred.states_at(0) is None:
            raise ValueError(f"{source} predicts no model states (states=True)")
        kinds.append(("states", m.states_by_step, pred.states_at, 0))
    diffs = _figure_diffs(kinds, len(m.losses))
    if diffs:
        raise BytesDiffer(bytes_report(result, source, diffs, [k[0] for k in kinds]))
    return result
