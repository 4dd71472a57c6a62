"""``parbench verify scheme=pkg.module:Class``: a user's own scheme against the golden run, the
native scheme of its family and the closed-form bytes.

Cases: ``suite=NAME`` takes that suite's cases of the scheme's family (the scheme swapped in,
duplicates and cases its ``check`` rejects left out, saying why); ``key=value`` fields alone
make one case; neither gives the family's default case set (``parbench.testing.defaults``:
micro-batches, odd shapes, odd dp, tied embeddings, every declared option's values -- the
set ``assert_equivalent`` and ``cases`` use too).

Each case stands beside a native scheme (``baseline_of`` if the class names one, else
``NATIVE``, else a further native of the family that accepts the case, ``ALTERNATES``; both
in ``parbench.testing.defaults``); where the case has timed steps past warm-up, that native
scheme runs it too on the same ranks' pool, for the time ratio. Bytes: when the class states its own
``predict``, its measured traffic must equal it (part of the verdict, as for native
schemes); otherwise the measured bytes are shown beside the native scheme's closed form and
fail the run only with ``strict_bytes=true``.

Exit: 0 every case equivalent (and exact where bytes count), 3 not (the first failing step,
rank, tensor and difference are printed), 1 a rank crashed or hung, 2 bad input.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.markup import escape

from ..config import ConfigError
from ..overrides import apply_overrides, coerce, parse_overrides
# the native scheme each family's users compare with, and further ones for the cases the
# first rejects: beside the default case sets, which ``parbench.testing`` reads too
from ..testing.defaults import ALTERNATES, NATIVE
from .output import UsageError, console


def _absolute_spec(spec: str) -> str:
    """A file path spec made absolute, so every rank resolves the same file."""
    target, _, attr = spec.rpartition(":")
    if target.endswith(".py") or "/" in target:
        return f"{Path(target).resolve()}:{attr}"
    return spec


def _with_scheme(case, scheme: str):
    from ..suites import case_id
    case = apply_overrides(case, {"scheme": scheme})
    case.id = case_id(case)
    return case


def _cases(cls, spec: str, suite_name: str | None, ov: dict) -> tuple[list, list[str]]:
    """(the cases the scheme runs, why others were left out). With neither a suite nor a
    case field: the family's default case set (``parbench.testing.defaults``)."""
    from ..registry import get_scheme
    from ..suites import check_suite, expand, load_suite
    from ..testing.defaults import default_cases
    skipped: list[str] = []
    if suite_name:
        suite = load_suite(suite_name, ov)
        pool = [c for c in suite.cases if get_scheme(c.run.scheme).family == cls.family]
        if not pool:
            raise ConfigError(f"suite={suite_name!r} has no case of family {cls.family!r} "
                              f"(the family of scheme {spec})")
    elif ov:
        pool = expand({}, {**ov, "scheme": spec}, default_name="verify").cases
    else:
        pool, skipped = default_cases(cls, spec)
    out, seen = [], set()
    for case in pool:
        case = _with_scheme(case, spec)
        if case.id in seen:
            continue
        seen.add(case.id)
        try:
            cls.check(case)
        except ConfigError as e:
            skipped.append(f"{case.id}: {e}")
            continue
        out.append(case)
    if not out:
        raise ConfigError(f"scheme {spec} accepts none of the cases: " + "; ".join(skipped))
    from ..suites import Suite
    check_suite(Suite("verify", "", out))
    return out, skipped


def _native_of(cls) -> str:
    from ..registry import get_scheme
    name = cls.baseline_of or NATIVE.get(cls.family)
    if not name:
        raise ConfigError(f"scheme family {cls.family!r} has no native scheme; set baseline_of")
    get_scheme(name)
    return name


def _bytes_against(row, pred) -> tuple[bool | None, str]:
    """(measured == predicted on every rank, a one-line difference)."""
    measured = row.traffic.wire
    if pred is None or not measured:
        return None, "no closed form"
    want = pred.wire_at(len(row.verdict.losses) - 1) or []
    diffs = []
    for rank, (got, exp) in enumerate(zip(measured, want)):
        for axis in sorted(set(got) | set(exp)):
            g, e = got.get(axis, 0.0), exp.get(axis, 0.0)
            if abs(g - e) > 0.5:
                diffs.append(f"rank {rank} {axis}: {g:.0f} B measured, {e:.0f} B model")
    if not diffs:
        return True, "= closed form"
    return False, f"{len(diffs)} differ, e.g. " + diffs[0]


def _first_difference(measured: list, predicted: list | None) -> str:
    """'rank r key: x measured, y predicted' for the first figure that differs."""
    for rank, (got, exp) in enumerate(zip(measured, predicted or [])):
        for key in sorted(set(got or {}) | set(exp or {})):
            g, e = (got or {}).get(key, 0), (exp or {}).get(key, 0)
            if abs(float(g or 0) - float(e or 0)) > 0.5:
                return f"rank {rank} {key}: {g:.0f} measured, {e:.0f} predicted"
    return "on some checked step"


def _differing(row) -> list[tuple[str, str]]:
    """Which of the row's figures leave the closed form (issue 20, sec. 8: "bytes differ"
    was said when only the model states did): (name, its first difference) each."""
    t, ms = row.traffic, row.memory.states
    figures = [("wire bytes", t.wire_exact, t.wire, t.wire_predicted),
               ("calls", t.calls_exact, t.calls, t.calls_predicted),
               ("model states", ms.exact, ms.measured, ms.predicted)]
    return [(name, _first_difference(got, want))
            for name, ok, got, want in figures if ok is False]


@dataclass
class _Verify:
    """What ``verify`` holds a user's scheme to: its own closed form (``own_predict``), else
    the native scheme's (failing only with ``strict``)."""

    spec: str
    cls: type
    native: str
    native_cls: type
    own_predict: bool
    strict: bool

    def bytes_line(self, case, row, native: str | None) -> tuple[bool | None, str]:
        if self.own_predict:
            exact = row.exact if row.traffic.wire_exact is not None else None
            if exact is None:
                return None, "bytes: no traffic measured"
            if exact:
                return True, "bytes, calls and model states = its own closed form"
            differ = _differing(row)
            return False, (" and ".join(n for n, _ in differ) + " ≠ its own closed form ("
                           + "; ".join(f"{n}: {d}" for n, d in differ) + ")")
        if native is None:
            return None, (f"bytes not compared (no native {self.cls.family} scheme runs this "
                          "case)")
        from ..registry import get_scheme
        exact, line = _bytes_against(row, get_scheme(native).predict(case))
        return exact, f"bytes {line} ({native}'s closed form)"

    def native_for(self, case) -> str | None:
        """The native scheme that runs ``case`` beside the user's: ``baseline_of`` or the
        family's native, else a further native of the family (``ALTERNATES``) that
        accepts it; None when none does."""
        from ..registry import get_scheme
        names = (self.native,) if self.cls.baseline_of else \
            (self.native, *ALTERNATES.get(self.cls.family, ()))
        for name in names:
            try:
                get_scheme(name).check(_with_scheme(case, name))
            except ConfigError:
                continue
            return name
        return None

    def pairs(self, cases: list) -> list[tuple]:
        """Each case, the native scheme that stands beside it (None: none accepts it) and
        that scheme's twin run -- only where the case has timed steps past warm-up, which
        the time ratio needs (None otherwise)."""
        out = []
        for case in cases:
            native = self.native_for(case)
            timed = case.run.timed_steps > case.run.warmup_steps
            twin = _with_scheme(case, native) if native and timed else None
            out.append((case, native, twin))
        return out


def _report_case(v: _Verify, out, case, row, base, native) -> tuple[dict, str]:
    """Print one case's verdict beside ``native`` (its twin row ``base``, if run); (its JSON
    entry, ``ok`` | ``failed`` | ``crashed``)."""
    ver = row.verdict
    entry = {"case": case.id, "status": ver.status, "equivalent": ver.equivalent}
    if ver.status != "ok":
        f = ver.failure
        out.print(f"[red]CRASHED[/] {case.id}: rank {f.rank} {f.kind}\n{f.traceback}")
        return entry, "crashed"
    exact, bytes_line = v.bytes_line(case, row, native)
    ratio = (row.time.step_s / base.time.step_s
             if base and base.time.step_s and row.time.step_s else None)
    verdict = "[green]equivalent[/]" if ver.equivalent else "[red]NOT equivalent[/]"
    out.print(f"  {case.id}: {verdict}; max|Δ| loss {ver.max_loss_abs:.2g}, grad "
              f"{ver.max_grad_abs:.2g}, param {ver.max_param_abs:.2g}; "
              f"{bytes_line}" + (f"; time {ratio:.2f}x {native}" if ratio else ""),
              soft_wrap=True)
    first = ver.first_failure
    entry.update(bytes_exact=exact, time_ratio=ratio,
                 first_failure=asdict(first) if first else None)
    if not ver.equivalent:
        out.print(f"    [red]first failure[/]: {escape(str(first or 'no single check named'))}",
                  soft_wrap=True)
        return entry, "failed"
    if exact is False and (v.own_predict or v.strict):
        which = [n for n, _ in _differing(row)] if v.own_predict else ["bytes"]
        out.print(f"    [red]{' and '.join(which) or 'bytes'} differ[/] from the closed form"
                  + (" (strict_bytes=true)" if v.strict and not v.own_predict else ""))
        return entry, "failed"
    return entry, "ok"


def cmd_verify(args: list[str], as_json: bool = False, wide: bool = False) -> int:
    from ..registry import get_scheme
    from ..runner import results_dir, run_cases
    from ..scheme import Scheme

    ov = parse_overrides(args)
    if "scheme" not in ov:
        raise UsageError("verify needs scheme=pkg.module:Class (or path/to/file.py:Class)")
    spec = _absolute_spec(ov.pop("scheme"))
    suite_name = ov.pop("suite", None)
    strict = coerce(ov.pop("strict_bytes", "false"), bool, "strict_bytes")
    out_opt = ov.pop("out", None)
    cls = get_scheme(spec)
    native = _native_of(cls)
    v = _Verify(spec, cls, native, get_scheme(native),
                cls.predict.__func__ is not Scheme.predict.__func__, strict)
    cases, skipped = _cases(cls, spec, suite_name, ov)
    pairs = v.pairs(cases)
    out = console(stderr=as_json)
    out_dir = results_dir("verify", out_opt, False)
    out.print(f"[bold]parbench verify[/] {spec} (family {cls.family}, beside {native}): "
              f"{len(cases)} case(s), results in {out_dir}")
    for s in skipped:
        out.print(f"  [dim]left out {s}[/]")
    t0 = time.time()
    todo = list({c.id: c for case, _, twin in pairs for c in (case, twin)
                 if c is not None}.values())
    rows = {r.id: r for r in run_cases("verify", todo, out_dir)}
    report, outcomes = [], set()
    for case, native, twin in pairs:
        entry, outcome = _report_case(v, out, case, rows[case.id],
                                      rows.get(twin.id) if twin else None, native)
        report.append(entry)
        outcomes.add(outcome)
    if as_json:
        print(json.dumps(report, indent=2, default=str))
    out.print(f"wrote {out_dir / 'results.jsonl'} in {time.time() - t0:.1f} s")
    return 1 if "crashed" in outcomes else 3 if "failed" in outcomes else 0
