"""``parbench verify scheme=pkg.module:Class``: a user's own scheme against the golden run, the
native scheme of its family and the closed-form bytes.

Cases: ``suite=NAME`` takes that suite's cases of the scheme's family (the scheme swapped in,
duplicates and cases its ``check`` rejects left out, saying why); ``key=value`` fields alone
make one case; neither gives the family's small default case (the self-test's base case).

Each case runs twice on the same ranks' pool: the user's scheme and the native one it stands
beside (``baseline_of`` if the class names one, else :data:`NATIVE`). Bytes: when the class
states its own ``predict``, its measured traffic must equal it (part of the verdict, as for
native schemes); otherwise the measured bytes are shown beside the native scheme's closed
form and fail the run only with ``strict_bytes=true``.

Exit: 0 every case equivalent (and exact where bytes count), 3 not (the first failing step,
rank, tensor and difference are printed), 1 a rank crashed or hung, 2 bad input.
"""
from __future__ import annotations

import time
from pathlib import Path

from ..config import ConfigError
from ..overrides import apply_overrides, coerce, parse_overrides
from .output import UsageError, console

#: the native scheme each family's users compare with
NATIVE = {"data": "data.ddp", "pipeline": "pipeline.1f1b", "tensor": "tensor.megatron",
          "context": "context.ring-attention", "expert": "expert.alltoall",
          "hybrid": "hybrid"}


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
    """(the cases the scheme runs, why others were left out)."""
    from ..config import CaseConfig
    from ..scheme import get_scheme
    from ..selftest import FAMILY_CASES
    from ..suites import check_suite, expand, load_suite
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
        if cls.family not in FAMILY_CASES:
            raise ConfigError(f"family={cls.family!r} of scheme {spec} has no default case; "
                              "give suite=NAME or the case's fields")
        # the self-test's small base case, with timed steps for the time ratio
        pool = [apply_overrides(CaseConfig(), {**FAMILY_CASES[cls.family], "timed_steps": "3"})]
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
    from ..scheme import get_scheme
    name = cls.baseline_of or NATIVE.get(cls.family)
    if not name:
        raise ConfigError(f"scheme family {cls.family!r} has no native scheme; set baseline_of")
    get_scheme(name)
    return name


def _bytes_against(row, pred) -> tuple[bool | None, str]:
    """(measured == predicted on every rank, a one-line difference)."""
    if pred is None or not row.wire_bytes_per_rank:
        return None, "no closed form"
    last = len(row.losses) - 1
    want = pred.wire_at(last) or []
    diffs = []
    for rank, (got, exp) in enumerate(zip(row.wire_bytes_per_rank, want)):
        for axis in sorted(set(got) | set(exp)):
            g, e = got.get(axis, 0.0), exp.get(axis, 0.0)
            if abs(g - e) > 0.5:
                diffs.append(f"rank {rank} {axis}: {g:.0f} B measured, {e:.0f} B model")
    if not diffs:
        return True, "= closed form"
    return False, f"{len(diffs)} differ, e.g. " + diffs[0]


def describe_failure(row) -> str:
    """The first failing check of a row, in one line."""
    f = row.first_failure
    if not f:
        return "not equivalent (no single check named)"
    where = f"step {f['step']} rank {f['rank']}: " if "step" in f else ""
    what = f"{f['what']} {f.get('tensor', '')}".strip()
    if f.get("max_abs") is not None:
        what += f": max|ours - golden| = {f['max_abs']:.3g} > tolerance {f['tolerance']:.3g}"
    if f.get("detail"):
        what += f" ({f['detail']})"
    return where + what


def cmd_verify(args: list[str], as_json: bool = False, wide: bool = False) -> int:
    from ..runner import results_dir, run_cases
    from ..scheme import Scheme, get_scheme

    ov = parse_overrides(args)
    if "scheme" not in ov:
        raise UsageError("verify needs scheme=pkg.module:Class (or path/to/file.py:Class)")
    spec = _absolute_spec(ov.pop("scheme"))
    suite_name = ov.pop("suite", None)
    strict = coerce(ov.pop("strict_bytes", "false"), bool, "strict_bytes")
    out_opt = ov.pop("out", None)
    cls = get_scheme(spec)
    own_predict = cls.predict.__func__ is not Scheme.predict.__func__
    native = _native_of(cls)
    native_cls = get_scheme(native)
    cases, skipped = _cases(cls, spec, suite_name, ov)
    pairs = []
    for case in cases:
        twin = _with_scheme(case, native)
        try:
            native_cls.check(twin)
        except ConfigError:
            twin = None
        pairs.append((case, twin))
    out = console(stderr=as_json)
    out_dir = results_dir("verify", out_opt, False)
    out.print(f"[bold]parbench verify[/] {spec} (family {cls.family}, beside {native}): "
              f"{len(cases)} case(s), results in {out_dir}")
    for s in skipped:
        out.print(f"  [dim]left out {s}[/]")
    t0 = time.time()
    todo = [c for pair in pairs for c in pair if c is not None]
    rows = {r.id: r for r in run_cases("verify", todo, out_dir)}
    failed = crashed = 0
    report = []
    for case, twin in pairs:
        row, base = rows[case.id], rows.get(twin.id) if twin else None
        entry = {"case": case.id, "status": row.status, "equivalent": row.equivalent}
        if row.status != "ok":
            crashed += 1
            f = row.failure
            out.print(f"[red]CRASHED[/] {case.id}: rank {f.rank} {f.kind}\n{f.traceback}")
            report.append(entry)
            continue
        if own_predict:
            exact = row.exact if row.wire_exact is not None else None
            bytes_line = "= its own closed form" if exact else \
                ("≠ its own closed form" if exact is False else "no traffic measured")
        else:
            exact, bytes_line = _bytes_against(row, native_cls.predict(case))
            bytes_line += f" ({native}'s closed form)"
        bytes_fail = exact is False and (own_predict or strict)
        ratio = (row.step_time_s / base.step_time_s
                 if base and base.step_time_s and row.step_time_s else None)
        verdict = "[green]equivalent[/]" if row.equivalent else "[red]NOT equivalent[/]"
        out.print(f"  {case.id}: {verdict}; max|Δ| loss {row.max_loss_abs:.2g}, grad "
                  f"{row.max_grad_abs:.2g}, param {row.max_param_abs:.2g}; bytes "
                  f"{bytes_line}" + (f"; time {ratio:.2f}x {native}" if ratio else ""),
                  soft_wrap=True)
        if not row.equivalent:
            failed += 1
            out.print(f"    [red]first failure[/]: {describe_failure(row)}", soft_wrap=True)
        elif bytes_fail:
            failed += 1
            out.print("    [red]bytes differ[/] from the closed form"
                      + (" (strict_bytes=true)" if strict and not own_predict else ""))
        entry.update(bytes_exact=exact, time_ratio=ratio, first_failure=row.first_failure)
        report.append(entry)
    if as_json:
        import json
        print(json.dumps(report, indent=2, default=str))
    out.print(f"wrote {out_dir / 'results.jsonl'} in {time.time() - t0:.1f} s")
    if crashed:
        return 1
    return 3 if failed else 0
