"""``parbench selftest``: every mutant of the catalogue (``parbench.selftest``) must be
reported not equivalent by a check of the verdict, and the unmodified schemes equivalent on
the same cases over several seeds (no false alarm).

Each mutant runs on its base scheme's case (``base_case``: the family's small case plus the
mutant's own overrides). Its outcome is one of (issue 20, sec. 7):

- ``check``: the case ran and a check failed it -- the golden run, the update check, the
  wire bytes, the calls or the model states (``caught_by`` names which): a kill;
- ``crash``: a rank raised or hung -- the bug broke the run, no check judged its numbers;
- ``refused``: the scheme's ``check`` or a validator (the schedule validator) refused the case
  before it ran;
- ``survived``: the case passed.

A mutant whose scheme reports itself ``unavailable`` (its framework is not installed, e.g.
megatron-core) is not run: it is ``skipped``, with the reason, counted apart from the four
outcomes -- neither a kill nor a failure. Only ``check`` is a success of the verdict.
``profile=ci`` runs a stratified sample (``ci_sample``): at least one mutant of every native
scheme that has mutants and of every framework whose baselines have some.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import asdict

from .config import CaseConfig, ConfigError
from .launch import RankError
from .overrides import apply_overrides
from .registry import get_scheme
from .runner import PoolCache, case_row, failed_row
from .selftest import CI_SUBSET, FAMILY_CASES, Mutant, load
from .suites import case_id

OUTCOMES = ("check", "crash", "refused", "survived")
#: a mutant not run because its scheme is unavailable here (not one of the outcomes)
SKIPPED = "skipped"
#: the last line of a rank's traceback when the scheme refused its case while it was built
_REFUSAL = re.compile(r"\b(ConfigError|ScheduleError)\b")


def base_case(m: Mutant, scheme: str, seed: int) -> CaseConfig:
    """The case ``m`` runs on (its family's, with its overrides), as ``scheme``."""
    family = get_scheme(m.base).family
    case = apply_overrides(CaseConfig(), {**FAMILY_CASES[family], **m.overrides,
                                          "scheme": scheme, "seed": str(seed)})
    case.id = case_id(case)
    return case


def caught_by(row) -> str:
    """Which checks of the verdict failed (for the report); the failure's kind for a row that
    did not run to its verdict."""
    v = row.verdict
    if v.status != "ok":
        return v.failure.kind if v.failure else "failed"
    checks = {"golden": v.golden_ok, "update": v.update_ok, "timed": v.timed_ok,
              "final": v.final_ok, "wire": row.traffic.wire_exact,
              "calls": row.traffic.calls_exact, "model_state": row.memory.states.exact}
    return "+".join(name for name, ok in checks.items() if ok is False) or "-"


def outcome(row) -> str:
    """One of ``OUTCOMES`` for a mutant's row (module docstring)."""
    v = row.verdict
    if v.status == "ok":
        return "survived" if row.passed else "check"
    f = v.failure
    if f is None:
        return "crash"
    if f.kind == "refused" or _REFUSAL.search(_last_line(f.traceback or f.message or "")):
        return "refused"
    return "crash"


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def stratum(base: str) -> str:
    """The ``ci`` sample's stratum of a mutant's base scheme: a native scheme is its own; a
    framework's baselines (``baseline.<framework>.*``) are one, their mutants all checking
    how parbench maps its weights into one library, each of whose runs starts the library's
    own processes."""
    parts = base.split(".")
    return ".".join(parts[:2]) if parts[0] == "baseline" else base


def ci_sample(catalogue: dict[str, Mutant]) -> list[str]:
    """The ``ci`` profile: ``CI_SUBSET`` (one mutant per kind of check) and, for every
    stratum it leaves out (:func:`stratum`: every native scheme, every framework), one of
    its mutants -- of its plainest scheme (the shortest name), then a stable pick (the
    smallest hash of the id), so that the sample is the same on every run and not always
    the first written."""
    chosen = [i for i in CI_SUBSET if i in catalogue]
    covered = {stratum(catalogue[i].base) for i in chosen}
    for key in sorted({stratum(m.base) for m in catalogue.values()} - covered):
        ms = [m for m in catalogue.values() if stratum(m.base) == key]
        chosen.append(min(ms, key=lambda m: (len(m.base),
                                             hashlib.sha1(m.id.encode()).hexdigest())).id)
    return chosen


class _Refusal(RankError):
    """A case its scheme's ``check`` refused before any rank ran."""

    kind = "refused"


def _refused_row(case: CaseConfig, error: ConfigError):
    return failed_row("selftest", case, _Refusal(-1, f"{type(error).__name__}: {error}"))


class _Runner:
    """Rows of the self-test's cases on shared pools (a fresh one for ``isolated`` schemes);
    the controls run once per (base, overrides, seed)."""

    def __init__(self, share_pools: bool = False):
        self.pools = PoolCache(shared=share_pools)
        self.controls: dict[tuple, object] = {}

    def row(self, case: CaseConfig):
        cls = get_scheme(case.run.scheme)
        try:
            cls.check(case)
        except ConfigError as e:
            return _refused_row(case, e)
        try:
            return case_row(case, None if cls.isolated else self.pools.get(case), "selftest")
        except RankError as e:
            return failed_row("selftest", case, e)

    def control(self, m: Mutant, seed: int, progress):
        key = (m.base, tuple(sorted(m.overrides.items())), seed)
        if key not in self.controls:
            self.controls[key] = self.row(base_case(m, m.base, seed))
            if progress:
                progress("control", m, self.controls[key])
        return self.controls[key]


def _entry(m: Mutant, row, controls_passed: bool) -> dict:
    v = row.verdict
    how = outcome(row)
    return {**asdict(m), "outcome": how, "killed": how == "check", "caught_by": caught_by(row),
            "failure": v.failure.message if v.failure else None,
            "first_failure": str(v.first_failure) if v.first_failure else None,
            "detectable_grad_error": v.detectable_grad_error,
            "clipped_steps": v.clipped_steps, "clip_coef_min": v.clip_coef_min,
            "max_loss_abs": v.max_loss_abs, "max_grad_abs": v.max_grad_abs,
            "max_param_abs": v.max_param_abs, "max_update_excess": v.max_update_excess,
            "controls_passed": controls_passed}


def run_selftest(profile: str = "full", seeds: int = 5, only: list[str] | None = None,
                 progress=None, share_pools: bool = False) -> dict:
    """Run the catalogue (``profile``: ``full``, or ``ci``: the stratified sample); returns
    the counts per outcome, the false alarms and one entry per mutant (``cases``).
    ``share_pools``: run on the process-wide pools (``runner.PoolCache``; the pytest
    session's) instead of starting the self-test's own."""
    catalogue = load()
    sample = set(ci_sample(catalogue)) if profile == "ci" else set(catalogue)
    chosen = [m for m in catalogue.values()
              if m.id in sample and (only is None or m.id in only)]
    runner = _Runner(share_pools)
    cases: list[dict] = []
    try:
        for m in chosen:
            why = get_scheme(m.scheme).unavailable()
            if why:
                cases.append(_skipped(m, why))
                if progress:
                    progress(SKIPPED, m, why)
                continue
            controls = [runner.control(m, s, progress) for s in range(1, seeds + 1)]
            row = runner.row(base_case(m, m.scheme, 1))
            cases.append(_entry(m, row, all(c.passed for c in controls)))
            if progress:
                progress("mutant", m, row)
    finally:
        runner.pools.close()
    return summary(cases, runner.controls, seeds)


def _skipped(m: Mutant, why: str) -> dict:
    return {**asdict(m), "outcome": SKIPPED, "killed": False, "caught_by": "-",
            "failure": None, "skipped_because": why}


def summary(cases: list[dict], controls: dict, seeds: int) -> dict:
    """The self-test's result: counts per outcome, false alarms, the entries."""
    count = {o: sum(c["outcome"] == o for c in cases) for o in (*OUTCOMES, SKIPPED)}
    false_alarms = sorted({f"{k[0]} seed {k[2]}: {why_failed(r)}" for k, r in controls.items()
                           if not r.passed})
    bases = sorted({c["base"] for c in cases})
    return {"mutants": len(cases), "killed": count["check"],
            "killed_by_check": count["check"], "killed_by_crash": count["crash"],
            "refused": count["refused"], "survived": count["survived"],
            "skipped": count[SKIPPED],
            "false_alarms": len(false_alarms), "false_alarm_cases": false_alarms,
            "schemes": bases, "seeds": seeds, "controls": len(controls), "cases": cases}


def why_failed(row) -> str:
    """What failed an unmodified scheme's row: the checks, or the failure's first line."""
    f = row.verdict.failure
    return f"{f.kind}: {f.message.splitlines()[0][:160]}" if f else caught_by(row)


def summary_line(result: dict) -> str:
    """'N killed by a check, M by a crash, K refused before running, S survived (of T
    mutants); F false alarm(s) over C unmodified runs (s seeds)'."""
    n = {k: result.get(k, 0) for k in ("killed_by_check", "killed_by_crash", "refused",
                                        "survived", "mutants", "false_alarms", "controls",
                                        "skipped")}
    skipped = f", {n['skipped']} skipped (framework not installed)" if n["skipped"] else ""
    return (f"{n['killed_by_check']} killed by a check, {n['killed_by_crash']} by a crash, "
            f"{n['refused']} refused before running, {n['survived']} survived{skipped} (of "
            f"{n['mutants']} mutants of {len(result.get('schemes', ()))} schemes); "
            f"{n['false_alarms']} false alarm(s) over {n['controls']} unmodified runs "
            f"({result.get('seeds', 0)} seeds)")


def exit_status(result: dict) -> int:
    """0: every mutant killed by a check and no false alarm; 3: a mutant survived or a
    correct scheme failed (the verdict missed, or raised a false alarm); 1: otherwise a
    mutant was only killed by a crash or refused before running (it does not test the
    verdict: the catalogue must be fixed)."""
    if result.get("survived") or result.get("false_alarms"):
        return 3
    if result.get("killed_by_crash") or result.get("refused"):
        return 1
    return 0
