"""Suites: YAML files of cases, expanded into CaseConfigs and run on local ranks.

A suite file has ``name``, ``description``, ``defaults`` (overrides for every case), an
optional ``grid`` (cartesian product of overrides) and an optional ``cases`` list. Overrides
use the command line's ``key=value`` keys. Command-line overrides apply last, to every case.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .config import CaseConfig, ConfigError, apply_overrides, validate_case

SUITE_DIR = Path(__file__).resolve().parents[1] / "suites"


def suite_dirs() -> list[Path]:
    """The checkout's suites/ (an editable install keeps it beside the package), then
    ./suites of the working directory (a user's own suites win on a name clash)."""
    dirs = [SUITE_DIR, Path.cwd() / "suites"]
    return [d for d in dirs if d.is_dir()]


def available_suites() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for d in reversed(suite_dirs()):
        for p in sorted(d.glob("*.yaml")):
            out[p.stem] = p
    return dict(sorted(out.items()))


@dataclass
class Suite:
    name: str
    description: str
    cases: list[CaseConfig] = field(default_factory=list)


def case_id(case: CaseConfig) -> str:
    d = case.to_dict()
    d.pop("id", None)
    digest = hashlib.sha1(json.dumps(d, sort_keys=True).encode()).hexdigest()[:8]
    p = case.parallel
    degrees = "-".join(f"{a}{getattr(p, a)}" for a in ("tp", "cp", "ep", "dp", "pp")
                       if getattr(p, a) > 1) or "single"
    return f"{case.run.scheme}:{degrees}:{digest}"


def load_suite(name: str, overrides: dict | None = None) -> Suite:
    suites = available_suites()
    path = Path(name) if name.endswith((".yaml", ".yml")) else suites.get(name)
    if path is None or not path.exists():
        raise ConfigError(f"suite={name!r} does not exist (choose from {', '.join(suites)})")
    with open(path) as fh:
        spec = yaml.safe_load(fh) or {}
    return expand(spec, overrides or {}, default_name=path.stem)


def _as_overrides(d: dict) -> dict[str, str]:
    return {str(k): (str(v).lower() if isinstance(v, bool) else str(v)) for k, v in d.items()}


def expand(spec: dict, overrides: dict, default_name: str = "suite") -> Suite:
    defaults = _as_overrides(spec.get("defaults") or {})
    rows: list[dict] = []
    grid = spec.get("grid") or {}
    if grid:
        keys = list(grid)
        for combo in itertools.product(*(grid[k] if isinstance(grid[k], list) else [grid[k]]
                                         for k in keys)):
            rows.append(dict(zip(keys, combo)))
    rows.extend(spec.get("cases") or [])
    if not rows:
        rows = [{}]
    cases = []
    seen = set()
    for row in rows:
        merged = dict(defaults)
        merged.update(_as_overrides(row))
        merged.update(_as_overrides(overrides))
        # a preset chosen by the row or the command line is applied before field overrides
        case = apply_overrides(CaseConfig(), merged)
        case.id = case_id(case)
        if case.id in seen:
            continue
        seen.add(case.id)
        cases.append(case)
    return Suite(name=spec.get("name", default_name), description=spec.get("description", ""),
                 cases=cases)


def check_suite(suite: Suite, world_size: int | None = None) -> None:
    """Every check that can run before spawning: config rules, scheme exists, scheme rules."""
    from .scheme import get_scheme
    for case in suite.cases:
        validate_case(case, world_size)
        get_scheme(case.run.scheme).check(case)


# ---- running ---------------------------------------------------------------------------------


def results_dir(suite_name: str, out: str | None, resume: bool) -> Path:
    if out:
        return Path(out)
    base = Path("results")
    if resume:
        prior = sorted(base.glob(f"{suite_name}-*"))
        if prior:
            return prior[-1]
    import time
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return base / f"{suite_name}-{stamp}"


def run_suite(suite: Suite, out_dir: Path, resume: bool = False, progress=None) -> list[dict]:
    """Run every case on local ranks; append a row per finished case; return all rows.

    Cases run grouped by world size on one shared pool per size; a scheme marked
    ``isolated`` gets a pool of its own. A failing rank raises ``RankError`` after the rows
    of finished cases are on disk.
    """
    from .launch import WorkerPool
    from .results import append_row, load_rows
    from .scheme import get_scheme

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "results.jsonl"
    done = {r["id"] for r in load_rows(path)} if resume and path.exists() else set()
    todo = [c for c in suite.cases if c.id not in done]
    rows = load_rows(path) if path.exists() and resume else []
    pools: dict[int, WorkerPool] = {}
    try:
        for i, case in enumerate(todo):
            cls = get_scheme(case.run.scheme)
            world = case.parallel.world_size
            if progress:
                progress("start", i, len(todo), case, None)
            if cls.isolated:
                with WorkerPool(world, device=case.run.device,
                                timeout_s=case.run.timeout_s) as pool:
                    per_rank = pool.run(_run_case, case.to_dict(),
                                        timeout_s=case.run.timeout_s * 4)
            else:
                pool = pools.get(world)
                if pool is None or not pool.alive:
                    pool = WorkerPool(world, device=case.run.device,
                                      timeout_s=case.run.timeout_s)
                    pools[world] = pool
                per_rank = pool.run(_run_case, case.to_dict(), timeout_s=case.run.timeout_s * 4)
            row = make_row(suite.name, case, per_rank, out_dir)
            append_row(path, row)
            rows.append(row)
            if progress:
                progress("done", i, len(todo), case, row)
    finally:
        for pool in pools.values():
            pool.close(force=not pool.alive)
    return rows


def _run_case(wctx, case_dict):
    from .harness import run_case
    return run_case(wctx, case_dict)


def make_row(suite_name: str, case: CaseConfig, per_rank: list[dict], out_dir: Path) -> dict:
    """One results row: equivalence, timing, memory, traffic, measured beside predicted."""
    import torch

    from .harness import merge_ranks
    from .scheme import get_scheme
    from .timeline import chrome_trace

    cls = get_scheme(case.run.scheme)
    golden = cls.reference(case, case.run.steps)
    merged = merge_ranks(per_rank, sorted(golden.params[0]))
    pred = cls.predict(case) or {}
    p = case.parallel
    tokens = p.global_batch_size * case.model.seq_length
    trace_dir = out_dir / "traces"
    trace_dir.mkdir(exist_ok=True)
    safe = case.id.replace(":", "_").replace("/", "_")
    events = [e for r in per_rank for e in r["timeline"]]
    chrome_trace(events, str(trace_dir / f"{safe}.json"))
    figures = cls.write_figures(case, per_rank, out_dir) if hasattr(cls, "write_figures") else []
    axes = sorted({a for w in merged["wire_by_axis"] for a in w})
    wire_measured = {a: max(w.get(a, 0.0) for w in merged["wire_by_axis"]) for a in axes}
    wire_exact, states_exact = _exact_per_rank(pred, merged)
    from .peak import predicted_peak
    peak_pred = predicted_peak(case, cls.family, pred.get("model_state_bytes"))
    extra = {}
    for r in per_rank:
        for k, v in (r.get("extra") or {}).items():
            extra.setdefault(k, v)
    return {
        "id": case.id,
        "suite": suite_name,
        "scheme": case.run.scheme,
        "family": cls.family,
        "baseline_of": cls.baseline_of,
        "world_size": p.world_size,
        "degrees": {a: getattr(p, a) for a in ("tp", "cp", "ep", "dp", "pp", "vpp")},
        "model": case.model.name,
        "case": case.to_dict(),
        "equivalent": merged["equivalent"],
        "max_loss_abs": merged["max_loss_abs"],
        "max_grad_abs": merged["max_grad_abs"],
        "max_param_abs": merged["max_param_abs"],
        "tolerance": {"rtol": case.run.rtol, "atol": case.run.atol,
                      "param_atol": case.run.param_atol},
        "uncovered": merged["uncovered"],
        "losses": merged["losses"],
        "golden_losses": golden.losses,
        "step_time_s": merged["step_time_s"],
        "tokens_per_s": tokens / merged["step_time_s"] if merged["step_time_s"] else None,
        "peak_bytes": merged["peak_bytes"],
        "peak_bytes_predicted": peak_pred,
        "model_state_bytes": merged["model_state_bytes"],
        # peak minus model states: activations, communication buffers, temporaries
        "other_peak_bytes": [(pk - sum(st.values())) if pk is not None and st else None
                             for pk, st in zip(merged["peak_bytes"],
                                               merged["model_state_bytes"])],
        "model_state_bytes_predicted": pred.get("model_state_bytes"),
        "wire_bytes": wire_measured,
        "wire_bytes_per_rank": merged["wire_by_axis"],
        "wire_bytes_predicted": pred.get("wire_bytes"),
        # every rank's measured figure equals its own prediction (None: no prediction)
        "wire_exact": wire_exact,
        "model_state_exact": states_exact,
        "prediction": {k: v for k, v in pred.items()
                       if k not in ("wire_bytes", "model_state_bytes")},
        "ledger_summary": _ledger_summary(per_rank[0]["ledger"]),
        "extra": extra,
        "figures": [str(f) for f in figures],
        "trace": str(trace_dir / f"{safe}.json"),
        "host_cpus": os.cpu_count(),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
    }


def _exact_per_rank(pred: dict, merged: dict) -> tuple[bool | None, bool | None]:
    """Compare each rank with its prediction: ``*_per_rank`` lists when a scheme gives them
    (pipeline stages differ), else the one figure every rank should show."""
    world = len(merged["wire_by_axis"])
    out = []
    for key, measured, tol in (("wire_bytes", merged["wire_by_axis"], 0.5),
                               ("model_state_bytes", merged["model_state_bytes"], 0)):
        per_rank = pred.get(f"{key}_per_rank") or ([pred[key]] * world if pred.get(key) else None)
        if not per_rank or any(m is None for m in measured):
            out.append(None)
            continue
        ok = True
        for m, p in zip(measured, per_rank):
            for k in set(m) | set(p):
                if abs(float(m.get(k, 0) or 0) - float(p.get(k, 0) or 0)) > tol:
                    ok = False
        out.append(ok)
    return out[0], out[1]


def _ledger_summary(records: list[dict]) -> dict:
    out: dict = {}
    for r in records:
        e = out.setdefault(f"{r['axis']}/{r['op']}", {"count": 0, "message_bytes": 0,
                                                       "wire_bytes": 0.0})
        e["count"] += 1
        e["message_bytes"] += r["message_bytes"]
        e["wire_bytes"] += r["wire_bytes"]
    return out


def env_for_torchrun() -> dict:
    return {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
