"""From a case to a typed row: pools, resume and progress.

``case_row`` is the one path from a case to a ``Row``: it runs the case on every rank of a
pool (or a fresh pool for schemes marked ``isolated``) and turns the per-rank results into a
row with the verdict, measurements and predictions. ``run_cases`` runs a list of cases
(a suite) with one shared pool per world size, appending each row to ``results.jsonl`` as soon
as its case ends. The torchrun path (``torchrun_case_row``) gathers the per-rank results on
rank 0 and builds the same row.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Callable

from .config import CaseConfig
from .launch import RankError, WorkerPool
from .results import Failure, RankResult, Row, append_row, load_rows
from .scheme import get_scheme
from .timeline import chrome_trace
from .checks import detectable_wd_error, golden_detectable_wd_error
from .verdict import Merged, exact_every_step, merge_ranks

Progress = Callable[[str, int, int, CaseConfig, "Row | None"], None]


def _run_case_task(wctx, case_dict):
    from .harness import run_case
    return run_case(wctx, case_dict)


def run_per_rank(case: CaseConfig, pool: WorkerPool | None = None) -> list[RankResult]:
    """Every rank's result of ``case`` (on ``pool``, or a fresh pool when the scheme is
    ``isolated`` or no pool is given)."""
    cls = get_scheme(case.run.scheme)
    run = case.run
    limit = run.timeout_s * 4
    if cls.isolated or pool is None:
        with WorkerPool(case.layout.world_size, device=run.device, timeout_s=run.timeout_s,
                        threads=run.threads_per_rank) as fresh:
            return fresh.run(_run_case_task, case.to_dict(), timeout_s=limit,
                             hang_timeout_s=run.hang_timeout_s)
    return pool.run(_run_case_task, case.to_dict(), timeout_s=limit,
                    hang_timeout_s=run.hang_timeout_s)


def case_row(case: CaseConfig, pool: WorkerPool | None = None, suite: str = "",
             out_dir: Path | None = None) -> Row:
    """Run ``case`` and return its row (traces and figures under ``out_dir`` if given)."""
    return make_row(suite, case, run_per_rank(case, pool), out_dir)


def make_row(suite: str, case: CaseConfig, per_rank: list[RankResult],
             out_dir: Path | None = None) -> Row:
    """One results row: equivalence, timing, memory, traffic, measured beside predicted."""
    import torch

    from .analytic.peak import predicted_peak

    cls = get_scheme(case.run.scheme)
    golden = cls.reference(case, case.run.steps)
    merged = merge_ranks(per_rank, sorted(golden.params[0]))
    pred = cls.predict(case)
    p = case.layout
    trace = figures = None
    if out_dir is not None:
        trace = _write_trace(case, per_rank, Path(out_dir))
        figures = [str(f) for f in cls.figures(case, per_rank, Path(out_dir))]
    states_pred = pred.model_state_bytes if pred else None
    traffic_pred = pred if pred and case.run.instrument else None  # not measured: no verdict
    last = case.run.steps - 1
    metrics: dict = {}
    for r in per_rank:
        for k, v in r.metrics.items():
            metrics.setdefault(k, v)
    return Row(
        id=case.id, suite=suite, scheme=case.run.scheme, family=cls.family,
        baseline_of=cls.baseline_of, world_size=p.world_size,
        degrees={**p.degrees(), "vpp": p.vpp},
        model=case.model.name, case=case.to_dict(),
        equivalent=merged.equivalent, golden_ok=merged.golden_ok,
        update_ok=merged.update_ok if cls.checks_update else None,
        max_loss_abs=merged.max_loss_abs,
        max_grad_abs=merged.max_grad_abs, max_param_abs=merged.max_param_abs,
        tolerance={"rtol": case.run.rtol, "atol": case.run.atol,
                   "param_atol": case.run.param_atol},
        uncovered=merged.uncovered, first_failure=merged.first_failure,
        losses=merged.losses, golden_losses=golden.losses,
        golden_source=getattr(golden, "source", "live"),
        step_time_s=merged.step_time_s,
        step_times_s=[list(r.step_times) for r in per_rank],
        tokens_per_s=(p.global_batch_size * case.model.seq_length / merged.step_time_s
                      if merged.step_time_s else None),
        peak_bytes=merged.peak_bytes,
        peak_bytes_predicted=predicted_peak(case, cls.family, states_pred[0]
                                            if states_pred else None),
        other_peak_bytes=_other_peak(merged),
        model_state_bytes=merged.model_state_bytes,
        model_state_bytes_predicted=states_pred,
        wire_bytes=merged.wire_measured, wire_bytes_per_rank=merged.wire_by_axis,
        wire_bytes_predicted=pred.max_wire(last) if pred else None,
        wire_bytes_predicted_per_rank=pred.wire_at(last) if pred else None,
        wire_exact=exact_every_step(merged.wire_by_step,
                                    traffic_pred.wire_at if traffic_pred else _nothing, tol=0.5),
        calls_exact=exact_every_step(merged.calls_by_step,
                                     traffic_pred.calls_at if traffic_pred else _nothing),
        model_state_exact=exact_every_step(merged.states_by_step,
                                           pred.states_at if pred else _nothing),
        calls_per_rank=merged.calls_by_step[-1],
        calls_predicted_per_rank=pred.calls_at(last) if pred else None,
        max_update_excess=merged.max_update_excess,
        detectable_wd_error=detectable_wd_error(case.run) if cls.checks_update
        else golden_detectable_wd_error(case.run),
        prediction=pred.figures if pred else {},
        ledger_summary=ledger_summary(per_rank[0].ledger),
        extra=metrics, figures=figures or [], trace=trace, host_cpus=os.cpu_count(),
        torch=torch.__version__, python=sys.version.split()[0])


def failed_row(suite: str, case: CaseConfig, error: RankError) -> Row:
    """The row of a case that crashed or hung: no verdict, the failure instead."""
    import torch
    cls = get_scheme(case.run.scheme)
    p = case.layout
    message = str(error)
    return Row(id=case.id, suite=suite, scheme=case.run.scheme, family=cls.family,
               baseline_of=cls.baseline_of, world_size=p.world_size,
               degrees={**p.degrees(), "vpp": p.vpp},
               model=case.model.name, case=case.to_dict(), status="failed",
               failure=Failure(kind=error.kind, rank=error.rank, message=message,
                               traceback=error.traceback_text),
               host_cpus=os.cpu_count(), torch=torch.__version__,
               python=sys.version.split()[0])


def _nothing(step: int):
    return None


def _other_peak(merged: Merged) -> list:
    """Peak minus model states: activations, communication buffers, temporaries."""
    return [(pk - sum(st.values())) if pk is not None and st else None
            for pk, st in zip(merged.peak_bytes, merged.model_state_bytes)]


def _write_trace(case: CaseConfig, per_rank: list[RankResult], out_dir: Path) -> str:
    trace_dir = out_dir / "traces"
    trace_dir.mkdir(parents=True, exist_ok=True)
    safe = case.id.replace(":", "_").replace("/", "_") or case.run.scheme
    path = trace_dir / f"{safe}.json"
    chrome_trace([e for r in per_rank for e in r.timeline], str(path))
    return str(path)


def ledger_summary(records: list[dict]) -> dict:
    """{'axis/op': {count, message_bytes, wire_bytes}} of one rank's ledger records."""
    out: dict = {}
    for r in records:
        e = out.setdefault(f"{r['axis']}/{r['op']}", {"count": 0, "message_bytes": 0,
                                                       "wire_bytes": 0.0})
        e["count"] += 1
        e["message_bytes"] += r["message_bytes"]
        e["wire_bytes"] += r["wire_bytes"]
    return out


# ---- many cases -------------------------------------------------------------------------------


def results_dir(suite_name: str, out: str | None, resume: bool) -> Path:
    """``out`` if given; else the newest ``results/<suite>-*`` when resuming; else a new one."""
    if out:
        return Path(out)
    base = Path("results")
    if resume:
        prior = sorted(base.glob(f"{suite_name}-*"))
        if prior:
            return prior[-1]
    return base / f"{suite_name}-{time.strftime('%Y%m%d-%H%M%S')}"


class PoolCache:
    """One live pool per (world size, device), restarted when a task killed it."""

    def __init__(self):
        self._pools: dict[tuple, WorkerPool] = {}

    def get(self, case: CaseConfig) -> WorkerPool:
        run = case.run
        key = (case.layout.world_size, run.device, run.threads_per_rank, run.timeout_s)
        pool = self._pools.get(key)
        if pool is None or not pool.alive:
            pool = WorkerPool(key[0], device=run.device, timeout_s=run.timeout_s,
                              threads=run.threads_per_rank)
            self._pools[key] = pool
        return pool

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close(force=not pool.alive)
        self._pools.clear()


def run_cases(suite: str, cases: list[CaseConfig], out_dir: Path, resume: bool = False,
              progress: Progress | None = None) -> list[Row]:
    """Run every case on local ranks; append a row per case as soon as it ends; return all
    rows. A case whose rank crashes or hangs becomes a failed row (its pool is ended) and
    the next case runs on a fresh pool."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "results.jsonl"
    rows = load_rows(path) if resume else []
    done = {r.id for r in rows}
    todo = [c for c in cases if c.id not in done]
    pools = PoolCache()
    try:
        for i, case in enumerate(todo):
            if progress:
                progress("start", i, len(todo), case, None)
            cls = get_scheme(case.run.scheme)
            try:
                row = case_row(case, None if cls.isolated else pools.get(case), suite,
                               out_dir)
            except RankError as e:
                row = failed_row(suite, case, e)
            append_row(path, row)
            rows.append(row)
            if progress:
                progress("done", i, len(todo), case, row)
    finally:
        pools.close()
    return rows


def torchrun_case_row(wctx, case: CaseConfig, suite: str, out_dir: Path) -> Row | None:
    """Under torchrun: run ``case`` on this rank; rank 0 gathers every rank's result and
    returns the row (other ranks return None)."""
    import torch.distributed as dist

    from .harness import run_case
    res = run_case(wctx, case.to_dict())
    gathered = [None] * wctx.world_size if wctx.rank == 0 else None
    dist.gather_object(res, gathered, dst=0)
    if wctx.rank != 0:
        return None
    return make_row(suite, case, gathered, out_dir)
