"""The readable messages of ``parbench.testing``'s assertions: the failing check named, the
losses beside the golden run's, and measured bytes beside predicted ones."""
from __future__ import annotations

import dataclasses

from ..config import CaseConfig
from ..results import FirstFailure


def _g(x, fmt=".3g") -> str:
    return "-" if x is None else format(x, fmt)


def _mark(ok) -> str:
    return "✗" if ok is False else " "


def _describe(case: CaseConfig) -> str:
    """The case in ``key=value`` form: the model preset, the steps and every field off its
    default (the preset's, for the model)."""
    from ..config import PRESETS, Layout, ModelConfig, RunConfig, model_preset
    from ..options import FAMILY_OPTIONS
    name = case.model.name
    parts = [f"model={name}", f"steps={case.run.steps}"]
    model_default = model_preset(name) if name in PRESETS else ModelConfig()
    pairs = [(case.model, model_default), (case.layout, Layout())]
    pairs += [(getattr(case.options, fam), kind()) for fam, kind in FAMILY_OPTIONS.items()]
    if case.options.recompute != "none":
        parts.append(f"recompute={case.options.recompute}")
    for obj, default in pairs + [(case.run, RunConfig())]:
        for f in dataclasses.fields(obj):
            if f.name in ("name", "scheme", "steps"):
                continue
            v = getattr(obj, f.name)
            if v != getattr(default, f.name):
                parts.append(f"{f.name}={v}")
    return " ".join(parts)


def equivalence_report(result) -> str:
    """The message of ``NotEquivalent`` for ``result`` (a ``SchemeRun``): the case, the first
    failure, and per step and rank the loss beside the golden run's and the largest
    differences."""
    run, m = result.case.run, result.merged
    lines = [f"{result.spec} is not equivalent to the golden run",
             f"  case: {_describe(result.case)}",
             f"  first failure: {result.first_failure() or 'no single check named'}"]
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
                + (f"  <- {bad.what}" if bad else ""))
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


def bytes_report(result, source: str, diffs: list[tuple], kinds: list[str]) -> str:
    """The message of ``BytesDiffer`` for ``result`` (a ``SchemeRun``): the first step that
    differs in full, then a line per further step."""
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


def _failed_check(c) -> FirstFailure | None:
    """A StepCheck's first failing check from its flags alone (older records: no names)."""
    if c.loss_ok is False:
        return FirstFailure("loss", "loss", c.loss_abs)
    if not c.grad_ok:
        return FirstFailure("gradient", max_abs=c.grad_max_abs)
    if not c.param_ok:
        return FirstFailure("parameter", max_abs=c.param_max_abs)
    if c.update_ok is False:
        return FirstFailure("update", "(optimizer step)", c.update_excess, 1.0)
    if c.init_ok is False:
        return FirstFailure("init", "(initial parameters)", c.init_max_abs, 0.0)
    if c.missing:
        return FirstFailure("missing", c.missing[0])
    return None
