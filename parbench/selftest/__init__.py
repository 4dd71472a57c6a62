"""``parbench selftest``: every mutant must be reported not equivalent (killed), and the
unmodified schemes equivalent on the same cases over several seeds (no false alarm).

Each mutant runs on its base scheme's case (``base_case``: the tiny model on 2 ranks, 3
steps, small buckets so that DDP and ZeRO have several buckets / units, plus the mutant's own
overrides); a mutant is killed when its row does not pass -- not equivalent to the golden run,
bytes or model states off their closed forms, or a crash or hang -- and the row says which
check caught it.
"""
from __future__ import annotations

from dataclasses import asdict

from ..config import CaseConfig
from ..overrides import apply_overrides
from .catalogue import Mutant, load

#: the case every mutant of a family runs on (before the mutant's own overrides)
FAMILY_CASES = {
    "data": {"model": "tiny", "dp": "2", "steps": "3", "timed_steps": "0",
             "micro_batch_size": "2", "bucket_mb": "0.01"},
    "pipeline": {"model": "tiny-4l", "pp": "2", "steps": "3", "timed_steps": "0",
                 "micro_batch_size": "1", "num_microbatches": "4"},
    "context": {"model": "tiny", "cp": "2", "steps": "3", "timed_steps": "0",
                "micro_batch_size": "2"},
    "tensor": {"model": "tiny", "tp": "2", "vocab_size": "61", "steps": "3",
               "timed_steps": "0", "micro_batch_size": "2", "num_microbatches": "2"},
    "expert": {"model": "tiny", "dp": "2", "ep": "2", "num_experts": "4", "steps": "3",
               "timed_steps": "0", "micro_batch_size": "2", "num_microbatches": "2"},
    "hybrid": {"model": "tiny", "tp": "2", "dp": "2", "ep": "2", "etp": "1",
               "num_experts": "4", "steps": "3", "timed_steps": "0",
               "micro_batch_size": "2", "num_microbatches": "2"},
}
#: the mutants the ``ci`` profile runs (one per kind of check, a few per family)
CI_SUBSET = ("ddp-no-wd", "ddp-no-divide", "zero3-double-wd", "zero1-no-allgather",
             "local-sgd-sum", "1f1b-no-wd", "1f1b-unscaled-loss", "zbh1-skip-w",
             "ring-no-rescale", "cp-pos-embed-local", "tp-fg-swapped",
             "tp-vocab-padding-unmasked", "sp-allreduce-for-reducescatter",
             "ddp-debug-allreduce", "zero3-keeps-gathered-units",
             "hybrid-moe-tokens-not-split", "ep-edp-mean", "ep-debug-alltoall")


def base_case(m: Mutant, scheme: str, seed: int) -> CaseConfig:
    from ..scheme import get_scheme
    family = get_scheme(m.base).family
    case = apply_overrides(CaseConfig(), {**FAMILY_CASES[family], **m.overrides,
                                          "scheme": scheme, "seed": str(seed)})
    from ..suites import case_id
    case.id = case_id(case)
    return case


def caught_by(row) -> str:
    """Which check of the verdict failed first (for the report)."""
    if row.status != "ok":
        return row.failure.kind if row.failure else "failed"
    parts = []
    if row.golden_ok is False:
        parts.append("golden")
    if row.update_ok is False:
        parts.append("update")
    for name in ("wire_exact", "calls_exact", "model_state_exact"):
        if getattr(row, name) is False:
            parts.append(name.replace("_exact", ""))
    return "+".join(parts) or "-"


def run_selftest(profile: str = "full", seeds: int = 5, only: list[str] | None = None,
                 progress=None) -> dict:
    """Run the catalogue; returns ``{"mutants", "killed", "false_alarms", "cases": [...]}``."""
    from ..launch import RankError
    from ..runner import PoolCache, case_row, failed_row
    from ..scheme import get_scheme

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
                     "max_loss_abs": row.max_loss_abs, "max_grad_abs": row.max_grad_abs,
                     "max_param_abs": row.max_param_abs,
                     "max_update_excess": row.max_update_excess,
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
