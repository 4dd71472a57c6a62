"""``parbench selftest``: every mutant of the catalogue (``parbench.selftest``) must be
reported not equivalent (killed), and the unmodified schemes equivalent on the same cases over
several seeds (no false alarm).

Each mutant runs on its base scheme's case (``base_case``: the tiny model on 2 ranks, 3
steps, small buckets so that DDP and ZeRO have several buckets / units, plus the mutant's own
overrides); a mutant is killed when its row does not pass -- not equivalent to the golden run,
bytes or model states off their closed forms, or a crash or hang -- and the row says which
check caught it.
"""
from __future__ import annotations

from dataclasses import asdict

from .config import CaseConfig
from .launch import RankError
from .overrides import apply_overrides
from .registry import get_scheme
from .runner import PoolCache, case_row, failed_row
from .selftest import CI_SUBSET, FAMILY_CASES, Mutant, load
from .suites import case_id


def base_case(m: Mutant, scheme: str, seed: int) -> CaseConfig:
    """The case ``m`` runs on (its family's, with its overrides), as ``scheme``."""
    family = get_scheme(m.base).family
    case = apply_overrides(CaseConfig(), {**FAMILY_CASES[family], **m.overrides,
                                          "scheme": scheme, "seed": str(seed)})
    case.id = case_id(case)
    return case


def caught_by(row) -> str:
    """Which check of the verdict failed first (for the report)."""
    v = row.verdict
    if v.status != "ok":
        return v.failure.kind if v.failure else "failed"
    checks = {"golden": v.golden_ok, "update": v.update_ok, "wire": row.traffic.wire_exact,
              "calls": row.traffic.calls_exact, "model_state": row.memory.states.exact}
    return "+".join(name for name, ok in checks.items() if ok is False) or "-"


def run_selftest(profile: str = "full", seeds: int = 5, only: list[str] | None = None,
                 progress=None) -> dict:
    """Run the catalogue; returns ``{"mutants", "killed", "false_alarms", "cases": [...]}``."""
    catalogue = load()
    chosen = [m for m in catalogue.values()
              if (only is None or m.id in only) and (profile != "ci" or m.id in CI_SUBSET)]
    pools = PoolCache()
    cases: list[dict] = []

    def run(case):
        try:
            cls = get_scheme(case.run.scheme)
            return case_row(case, None if cls.isolated else pools.get(case), "selftest")
        except RankError as e:
            return failed_row("selftest", case, e)

    try:
        controls: dict[tuple, list] = {}
        for m in chosen:
            for seed in range(1, seeds + 1):
                key = (m.base, tuple(sorted(m.overrides.items())), seed)
                if key not in controls:
                    controls[key] = run(base_case(m, m.base, seed))
                    if progress:
                        progress("control", m, controls[key])
            row = run(base_case(m, m.scheme, 1))
            killed = not row.passed
            entry = {**asdict(m), "killed": killed, "caught_by": caught_by(row),
                     "max_loss_abs": row.verdict.max_loss_abs,
                     "max_grad_abs": row.verdict.max_grad_abs,
                     "max_param_abs": row.verdict.max_param_abs,
                     "max_update_excess": row.verdict.max_update_excess,
                     "controls_passed": all(controls[(m.base,
                                                      tuple(sorted(m.overrides.items())), s)]
                                            .passed for s in range(1, seeds + 1))}
            cases.append(entry)
            if progress:
                progress("mutant", m, row)
    finally:
        pools.close()
    false_alarms = sorted({f"{k[0]} seed {k[2]}" for k, r in controls.items() if not r.passed})
    return {"mutants": len(cases), "killed": sum(c["killed"] for c in cases),
            "false_alarms": len(false_alarms), "false_alarm_cases": false_alarms,
            "seeds": seeds, "controls": len(controls), "cases": cases}
