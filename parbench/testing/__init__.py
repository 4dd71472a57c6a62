"""Testing your own scheme with pytest: helpers, Hypothesis strategies and a pytest plugin.

Installing parbench registers the pytest plugin ``parbench.testing.plugin`` (entry point
``pytest11``), whose session fixture ``parbench_pool`` keeps one pool of local gloo ranks per
world size for the whole test session. The helpers below run on that pool::

    from hypothesis import given
    from parbench.testing import assert_bytes, assert_equivalent, cases, rank_settings

    from my_pkg.ddp import MyDDP

    def test_equivalent(parbench_pool):
        assert_equivalent(MyDDP, dp=2, model="tiny", steps=3)

    def test_bytes(parbench_pool):
        assert_bytes(MyDDP, dp=2, model="tiny")     # MyDDP.predict, or its family's native

    @rank_settings(max_examples=5)
    @given(case=cases(family="data", dp=2, scheme=MyDDP))
    def test_any_case(parbench_pool, case):
        assert_equivalent(MyDDP, case=case)

A case is given as keyword fields, the names of ``parbench run``'s ``key=value`` overrides
(``dp=2``, ``model="tiny"``, ``num_microbatches=2``, ``bucket_mb=0.01``, ...), or as a
``CaseConfig`` (``case=``, which the fields then change). The scheme is a ``Scheme`` subclass,
run by its import path ``"pkg.module:Class"`` (every rank imports it), or such a string.

Failures are ``AssertionError``s with a readable message: ``NotEquivalent`` names the first
failing step, rank, check and tensor with its difference and tolerance, and prints the losses
beside the golden run's; ``BytesDiffer`` lists, per step, rank and mesh axis, the measured
bytes and calls beside the predicted ones. A rank that raises or hangs is ``SchemeCrashed``,
with the rank's traceback.

Nothing heavy is imported here until a helper is called (the plugin loads in every pytest
session of an environment with parbench installed).
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import sys
import weakref
from dataclasses import dataclass
from typing import Any

from ..config import CaseConfig, ConfigError

__all__ = ["assert_equivalent", "assert_bytes", "cases", "rank_settings", "run_scheme",
           "make_case", "scheme_spec", "native_scheme", "SchemeRun", "NotEquivalent",
           "BytesDiffer", "SchemeCrashed", "FAMILIES"]


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
    from ..scheme import Scheme, get_scheme
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
    from ..scheme import get_scheme
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
    from ..cli.verify import NATIVE
    return NATIVE.get(family)


def native_scheme(scheme) -> str:
    """The native scheme a scheme is compared with, as ``parbench verify`` picks it: its
    ``baseline_of``, else its family's native scheme (``data`` -> ``data.ddp``, ...)."""
    from ..scheme import get_scheme
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

    def first_failure(self) -> dict | None:
        """The earliest failing check (step, rank, what, tensor, max_abs, tolerance): as the
        verdict records it, else assembled from the per-step flags (no tensor name)."""
        recorded = getattr(self.merged, "first_failure", None)
        if recorded:
            return recorded
        for s in range(len(self.merged.losses)):
            for r in self.per_rank:
                c = r.checks[s]
                what = _failed_check(c)
                if what:
                    return {"step": s, "rank": r.rank, **what}
        if self.merged.uncovered:
            return {"what": "uncovered", "tensor": self.merged.uncovered[0],
                    "detail": f"{len(self.merged.uncovered)} golden parameter(s) reported by "
                              "no rank"}
        return None


def _failed_check(c) -> dict | None:
    """A StepCheck's first failing check from its flags alone (older records: no names)."""
    if c.loss_ok is False:
        return {"what": "loss", "tensor": "loss", "max_abs": c.loss_abs}
    if not c.grad_ok:
        return {"what": "gradient", "max_abs": c.grad_max_abs}
    if not c.param_ok:
        return {"what": "parameter", "max_abs": c.param_max_abs}
    if c.update_ok is False:
        return {"what": "update", "tensor": "(optimizer step)", "max_abs": c.update_excess,
                "tolerance": 1.0}
    if c.init_ok is False:
        return {"what": "init", "tensor": "(initial parameters)", "max_abs": c.init_max_abs,
                "tolerance": 0.0}
    if c.missing:
        return {"what": "missing", "tensor": c.missing[0]}
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
    world = case.parallel.world_size
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
    from ..scheme import get_scheme
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


def assert_equivalent(scheme, *, case: CaseConfig | None = None, pool=None,
                      **fields) -> SchemeRun:
    """Run ``scheme`` on the case and assert it equals the golden run: every rank's loss and
    gradients against the stepwise golden, its optimizer update, its initial weights, every
    parameter covered. Raises ``NotEquivalent`` naming the first failing step, rank, check
    and tensor with the difference and the tolerance, and the losses beside the golden
    run's. Returns the ``SchemeRun`` (for further checks) when it passes."""
    result = run_scheme(scheme, case=case, pool=pool, **fields)
    if not result.equivalent:
        raise NotEquivalent(equivalence_report(result))
    return result


def _g(x, fmt=".3g") -> str:
    return "-" if x is None else format(x, fmt)


def _mark(ok) -> str:
    return "✗" if ok is False else " "


def _describe(case: CaseConfig) -> str:
    """The case in ``key=value`` form: the model preset, the steps and every field off its
    default (the preset's, for the model)."""
    from ..config import PRESETS, ModelConfig, ParallelConfig, RunConfig, model_preset
    name = case.model.name
    parts = [f"model={name}", f"steps={case.run.steps}"]
    model_default = model_preset(name) if name in PRESETS else ModelConfig()
    for obj, default in ((case.model, model_default), (case.parallel, ParallelConfig()),
                         (case.run, RunConfig())):
        for f in dataclasses.fields(obj):
            if f.name in ("name", "scheme", "steps"):
                continue
            v = getattr(obj, f.name)
            if v != getattr(default, f.name):
                parts.append(f"{f.name}={v}")
    return " ".join(parts)


def describe_failure(f: dict | None) -> str:
    """One line: where and what failed first, with the difference and the tolerance."""
    if not f:
        return "no single check named"
    where = f"step {f['step']}, rank {f['rank']}: " if "step" in f else ""
    what = f["what"]
    tensor = f.get("tensor")
    text = f"{what} {tensor!r}" if tensor and tensor != what else what
    if what == "update" and f.get("max_abs") is not None:
        text += (f": the step is {f['max_abs']:.3g} x its tolerance off the run's optimizer "
                 "applied to the reported gradients")
    elif f.get("max_abs") is not None:
        text += f": max|ours - golden| = {f['max_abs']:.3g}"
        if f.get("tolerance") is not None:
            text += f" > tolerance {f['tolerance']:.3g}"
    if what in ("gradient", "parameter") and not tensor:
        text += " (this parbench version does not record which tensor)"
    if f.get("detail") and what != "update":
        text += f" ({f['detail']})"
    return where + text


def equivalence_report(result: SchemeRun) -> str:
    """The message of ``NotEquivalent``: the case, the first failure, and per step and rank
    the loss beside the golden run's and the largest differences."""
    run, m = result.case.run, result.merged
    lines = [f"{result.spec} is not equivalent to the golden run",
             f"  case: {_describe(result.case)}",
             f"  first failure: {describe_failure(result.first_failure())}"]
    if m.uncovered:
        lines.append(f"  parameters no rank reported: {', '.join(m.uncovered[:6])}"
                     + (" ..." if len(m.uncovered) > 6 else ""))
    header = (f"  {'step':>4} {'rank':>4}  {'loss':>12} {'golden loss':>12} {'|Δ loss|':>9}"
              f"  {'grad max|Δ|':>11}  {'param max|Δ|':>12}  {'update/tol':>10}")
    lines += ["", header]
    for s in range(len(m.losses)):
        for r in result.per_rank:
            c = r.checks[s]
            bad = _failed_check(c)
            loss = _g(c.loss, "12.8f")
            gold = _g(c.golden_loss, "12.8f")
            lines.append(
                f"  {s:>4} {r.rank:>4}  {loss:>12} {gold:>12} {_g(c.loss_abs, '9.2e'):>9}"
                f"{_mark(c.loss_ok)} {c.grad_max_abs:11.3e}{_mark(c.grad_ok)} "
                f"{c.param_max_abs:12.3e}{_mark(c.param_ok)} "
                f"{_g(c.update_excess, '10.3g'):>10}{_mark(c.update_ok)}"
                + (f"  <- {bad['what']}" if bad else ""))
    stepwise = any(c.stepwise for r in result.per_rank for c in r.checks)
    lines += ["", f"  tolerances: loss and gradients max|ours - golden| <= atol + rtol * "
                  f"max|golden| per tensor (rtol {run.rtol:g}, atol {run.atol:g})"
                  + ("" if stepwise else f", later steps and parameters param_atol "
                                         f"{run.param_atol:g}")]
    if stepwise:
        lines.append("  golden: the stepwise golden (the single-device model at the scheme's "
                     "own weights before each step); |Δ loss| is against it, 'param max|Δ|' "
                     "is the drift from the golden trajectory (shown, not checked)")
    if any(c.update_ok is not None for r in result.per_rank for c in r.checks):
        lines.append("  update/tol: the optimizer step against the run's optimizer applied to "
                     "the reported gradients, in units of 2^-20 |p| + 2^-20 lr (<= 1 passes)")
    return "\n".join(lines)


# ---- bytes ------------------------------------------------------------------------------------


def _prediction_for(cls, spec: str, case: CaseConfig, expected):
    """(prediction, where it comes from)."""
    from ..scheme import Prediction, Scheme, get_scheme
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
    from ..scheme import get_scheme
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


def _figure_diffs(kinds, steps: int) -> list[tuple]:
    """(step, rank, key, kind, measured, predicted) for every figure off its prediction."""
    out = []
    for s in range(steps):
        for kind, measured_by_step, predicted_at, tol in kinds:
            measured, predicted = measured_by_step[s], predicted_at(s)
            for rank, got in enumerate(measured):
                want = predicted[rank] if rank < len(predicted) else {}
                got = got or {}
                for key in sorted(set(got) | set(want)):
                    g, w = float(got.get(key, 0) or 0), float(want.get(key, 0) or 0)
                    if abs(g - w) > tol:
                        out.append((s, rank, key, kind, g, w))
    return out


def bytes_report(result: SchemeRun, source: str, diffs: list[tuple], kinds: list[str]) -> str:
    """The message of ``BytesDiffer``: the first step that differs in full, then a line per
    further step."""
    m = result.merged
    first = diffs[0][0]
    differing = [k for k in kinds if any(d[3] == k for d in diffs)]
    lines = [f"{result.spec}: measured {' and '.join(differing)} differ from {source}",
             f"  case: {_describe(result.case)}",
             f"  step {first} (per rank and mesh axis; ≠ marks a difference):",
             f"  {'rank':>4}  {'axis':<10} {'what':<6} {'measured':>14} {'predicted':>14}"
             f" {'difference':>12}"]
    at_first = {(r, k, kind): (g, w) for s, r, k, kind, g, w in diffs if s == first}
    for rank in range(len(result.per_rank)):
        for kind, measured, pred_key in (("bytes", m.wire_by_step, "wire"),
                                         ("calls", m.calls_by_step, "calls"),
                                         ("states", m.states_by_step, "states")):
            if kind not in kinds:
                continue
            got = measured[first][rank] or {}
            keys = sorted(set(got) | {k for (r, k, kd) in at_first if r == rank and kd == kind})
            for key in keys:
                if (rank, key, kind) in at_first:
                    g, w = at_first[(rank, key, kind)]
                    lines.append(f"  {rank:>4}  {key:<10} {kind:<6} {g:>14,.0f} {w:>14,.0f}"
                                 f" {g - w:>+12,.0f} ≠")
                elif got.get(key):
                    g = float(got[key])
                    lines.append(f"  {rank:>4}  {key:<10} {kind:<6} {g:>14,.0f} {g:>14,.0f}"
                                 f" {0:>12}")
    later = sorted({s for s, *_ in diffs if s != first})
    for s in later:
        n = sum(1 for d in diffs if d[0] == s)
        lines.append(f"  step {s}: {n} figure(s) differ")
    return "\n".join(lines)


# ---- Hypothesis ----------------------------------------------------------------------------------

#: per family: what ``cases`` draws (lists are sampled; the rest is fixed). Small sizes, the
#: degrees each family runs on 2 local ranks (hybrid: 4), every field from the public config.
FAMILIES: dict[str, dict[str, Any]] = {
    "data": {"model": "tiny", "dp": [1, 2], "micro_batch_size": [1, 2],
             "num_microbatches": [1, 2, 3], "bucket_mb": [0.01, 0.05, 0.25],
             "vocab_size": [61, 128], "seq_length": [8, 16], "tie_embeddings": [False, True],
             "weight_decay": [0.0, 0.01, 0.1]},
    "pipeline": {"model": "tiny-4l", "pp": 2, "micro_batch_size": [1, 2],
                 "num_microbatches": [2, 3, 4], "vocab_size": [61, 128],
                 "weight_decay": [0.0, 0.01]},
    "tensor": {"model": "tiny", "tp": 2, "vocab_size": [61, 128], "micro_batch_size": [1, 2],
               "num_microbatches": [1, 2], "seq_length": [8, 16]},
    "context": {"model": "tiny", "cp": 2, "seq_length": [8, 16, 32],
                "micro_batch_size": [1, 2], "num_microbatches": [1, 2]},
    "expert": {"model": "tiny", "dp": 2, "ep": [1, 2], "num_experts": [2, 4],
               "moe_top_k": [1, 2], "moe_capacity_factor": [0.0, 1.0, 1.5],
               "moe_every": [1, 2], "micro_batch_size": 2, "num_microbatches": [1, 2]},
    "hybrid": {"model": "tiny-4l", "vocab_size": 61, "micro_batch_size": 2,
               "num_microbatches": [2, 4],
               "layout": [{"tp": 2, "pp": 2}, {"tp": 2, "dp": 2}, {"cp": 2, "dp": 2},
                          {"dp": 2, "pp": 2}, {"tp": 2, "cp": 2}]},
}

#: every family's cases: few steps, nothing timed, a drawn seed
_COMMON = {"steps": 2, "timed_steps": 0, "seed": range(0, 2**16)}


def cases(family: str = "data", **fixed):
    """A Hypothesis strategy of valid ``CaseConfig``s of small sizes for ``family``.

    ``fixed`` sets fields (``dp=2``) or draws them from your own strategy
    (``bucket_mb=st.floats(0.001, 1)``); ``scheme=MyScheme`` (a class or spec) sets the
    case's scheme and keeps only the cases its ``check`` accepts (default: the family's
    native scheme, ``data.ddp``, ``pipeline.1f1b``, ...). Cases the config rules reject are
    never drawn. ``FAMILIES`` lists what each family draws."""
    from hypothesis import strategies as st
    if family not in FAMILIES:
        raise ValueError(f"family={family!r} is not one of {', '.join(FAMILIES)}")
    scheme = fixed.pop("scheme", None) or _family_native(family)
    space = {**_COMMON, **FAMILIES[family], **fixed}

    def as_strategy(v):
        if isinstance(v, st.SearchStrategy):
            return v
        if isinstance(v, range):
            return st.integers(v.start, v.stop - 1)
        if isinstance(v, list):
            return st.sampled_from(v)
        return st.just(v)

    @st.composite
    def draw_case(draw):
        from hypothesis import reject
        drawn = {k: draw(as_strategy(v)) for k, v in space.items()}
        drawn.update(drawn.pop("layout", None) or {})
        try:
            return make_case(scheme, **drawn)
        except ConfigError:
            reject()

    return draw_case()


def rank_settings(max_examples: int = 5, **kw):
    """Hypothesis settings for property tests that run cases on ranks: no deadline (a case
    takes seconds), few examples, the health checks that a slow or fixture-using test trips
    off. Use as a decorator above ``@given``."""
    from hypothesis import HealthCheck, settings
    suppress = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                HealthCheck.filter_too_much]
    return settings(max_examples=max_examples, deadline=None,
                    suppress_health_check=kw.pop("suppress_health_check", suppress), **kw)
