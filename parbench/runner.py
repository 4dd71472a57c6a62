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
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

from .config import CaseConfig
from .launch import SHARED_TIMEOUT_S, RankError, WorkerPool, shared_pool
from .results import (Divergence, Environment, Failure, Memory, RankResult, Row, RowCase,
                      SchemeFigures, Timing, Traffic, append_row, load_rows)
from .registry import get_scheme
from .timeline import chrome_trace
from .verdict import (Merged, merge_ranks, states_of, timed_ledger, traffic_of,
                      verdict_of)

Progress = Callable[[str, int, int, CaseConfig, "Row | None"], None]


def _run_case_task(wctx, case_dict):
    from .harness import run_case
    return run_case(wctx, case_dict)


def _probe_task(wctx, task):
    from .localise import probe_case
    return probe_case(wctx, task)


def run_per_rank(case: CaseConfig, pool: WorkerPool | None = None) -> list[RankResult]:
    """Every rank's result of ``case`` (on ``pool``, or a fresh pool when the scheme is
    ``isolated`` or no pool is given)."""
    return _on_ranks(case, pool, _run_case_task, case.to_dict())


#: the checks of a checked step whose failure a module can explain (``localise``)
_LOCALISED = ("loss", "gradient")


def localise(case: CaseConfig, row: Row, pool: WorkerPool | None = None) -> None:
    """A failing row's first diverging module (issue 20, sec. 5): when its first failure is
    a checked step's loss or gradient and its scheme maps modules (``Scheme.module_probes``)
    and passes the update check (its golden model runs at its weights), rerun steps 0 to the
    failing one with probes (``parbench.localise``) and keep the earliest divergence over the
    ranks in ``row.verdict.first_divergence`` and in the first failure's line. A rerun that
    fails leaves the row as it is."""
    from .probes import reference_order
    from .scheme import Scheme
    from .verdict.divergence import earliest
    first, cls = row.verdict.first_failure, get_scheme(case.run.scheme)
    if row.passed or first is None or first.what not in _LOCALISED or first.step is None \
            or not cls.checks_update or cls.module_probes is Scheme.module_probes \
            or row.verdict.uncovered:
        return
    task = {"case": case.to_dict(), "last": first.step}
    try:
        found = _on_ranks(case, pool, _probe_task, task)
    except RankError:
        return
    from .localise import UNMAPPED
    mapped = [d for d in found if d != UNMAPPED]
    if not mapped:  # no rank maps a module: nothing was compared, so nothing is claimed
        return
    div = earliest(mapped, reference_order(case.model.num_layers)) or Divergence("none")
    row.verdict.first_divergence = div
    first.divergence = str(div)


def _on_ranks(case: CaseConfig, pool: WorkerPool | None, fn, arg) -> list:
    """``fn(wctx, arg)`` on every rank of ``pool`` (a fresh pool for isolated schemes)."""
    run = case.run
    if get_scheme(run.scheme).isolated or pool is None:
        with WorkerPool(case.layout.world_size, device=run.device, timeout_s=run.timeout_s,
                        threads=run.threads_per_rank) as fresh:
            return fresh.run(fn, arg, timeout_s=run.timeout_s * 4,
                             hang_timeout_s=run.hang_timeout_s)
    return pool.run(fn, arg, timeout_s=run.timeout_s * 4, hang_timeout_s=run.hang_timeout_s)


def case_row(case: CaseConfig, pool: WorkerPool | None = None, suite: str = "",
             out_dir: Path | None = None) -> Row:
    """Run ``case`` and return its row (traces and figures under ``out_dir`` if given)."""
    return make_row(suite, case, run_per_rank(case, pool), out_dir)


def make_row(suite: str, case: CaseConfig, per_rank: list[RankResult],
             out_dir: Path | None = None) -> Row:
    """One results row: equivalence, timing, memory, traffic, measured beside predicted."""
    cls = get_scheme(case.run.scheme)
    golden = cls.reference(case, case.run.steps)
    merged = merge_ranks(per_rank, sorted(golden.params[0]))
    pred = cls.predict(case)
    env = environment()
    if out_dir is not None:
        env.trace = _write_trace(case, per_rank, Path(out_dir))
        env.figures = [str(f) for f in cls.figures(case, per_rank, Path(out_dir))]
    verdict = verdict_of(case, cls, merged, golden, timed_ledger(case, merged, pred))
    return Row(case=row_case(suite, case, cls), verdict=verdict,
               time=timing(case, merged, per_rank), memory=memory(case, cls, merged, pred),
               traffic=traffic_of(case, merged, pred, per_rank[0].ledger),
               pipeline=next((r.bubble for r in per_rank if r.bubble is not None), None),
               scheme_figures=scheme_figures(per_rank),
               analytic=dict(pred.figures) if pred else {}, env=env)


def row_case(suite: str, case: CaseConfig, cls) -> RowCase:
    return RowCase(id=case.id, suite=suite, scheme=case.run.scheme, family=cls.family,
                   baseline_of=cls.baseline_of, model=case.model.name, layout=case.layout,
                   config=case.to_dict())


def timing(case: CaseConfig, merged: Merged, per_rank: list[RankResult]) -> Timing:
    """The slowest rank's median step, every rank's timed steps, and tokens per second."""
    step = merged.step_time_s
    tokens = case.layout.global_batch_size * case.model.seq_length
    cpu = [statistics.median(r.step_cpu_times) for r in per_rank if r.step_cpu_times]
    own = [statistics.median(r.step_own_cpu_times) for r in per_rank if r.step_own_cpu_times]
    shares = [r.verdict_s / r.case_s for r in per_rank if r.case_s > 0]
    return Timing(step_s=step, per_rank_s=[list(r.step_times) for r in per_rank],
                  tokens_per_s=tokens / step if step else None, cpu_s=max(cpu) if cpu else None,
                  own_cpu_s=max(own) if own else None,
                  per_rank_cpu_s=[list(r.step_cpu_times) for r in per_rank],
                  per_rank_own_cpu_s=[list(r.step_own_cpu_times) for r in per_rank],
                  threads_cpu_s=Traffic.largest([r.threads_cpu_s for r in per_rank]),
                  verdict_share=max(shares) if shares else None,
                  case_s=max((r.case_s for r in per_rank), default=None) or None)


def memory(case: CaseConfig, cls, merged: Merged, pred) -> Memory:
    """Peaks per rank beside the analytic peak, and the model states."""
    from .analytic.peak import predicted_peak
    states = states_of(merged, pred)
    first = states.predicted[0] if states.predicted else None
    return Memory(peak_bytes=merged.peak_bytes,
                  peak_predicted=predicted_peak(case, cls.family, first), states=states)


def scheme_figures(per_rank: list[RankResult]) -> SchemeFigures:
    """The scheme's own figures: each key as the lowest rank reporting it gives it."""
    out: SchemeFigures = {}
    for r in per_rank:
        for k, v in r.metrics.items():
            out.setdefault(k, v)
    return out


def environment() -> Environment:
    import torch
    return Environment(host_cpus=os.cpu_count(), torch=torch.__version__,
                       python=sys.version.split()[0])


def failed_row(suite: str, case: CaseConfig, error: RankError) -> Row:
    """The row of a case that crashed or hung: no verdict, the failure instead."""
    row = Row(case=row_case(suite, case, get_scheme(case.run.scheme)), env=environment())
    row.verdict.status = "failed"
    row.verdict.failure = Failure(kind=error.kind, rank=error.rank, message=str(error),
                                  traceback=error.traceback_text)
    return row


def _write_trace(case: CaseConfig, per_rank: list[RankResult], out_dir: Path) -> str:
    trace_dir = out_dir / "traces"
    trace_dir.mkdir(parents=True, exist_ok=True)
    safe = case.id.replace(":", "_").replace("/", "_") or case.run.scheme
    path = trace_dir / f"{safe}.json"
    chrome_trace([e for r in per_rank for e in r.timeline], str(path))
    return str(path)


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
    """One live pool per (world size, device), restarted when a task killed it. ``shared``:
    a case with the process-wide pools' settings (one thread per rank, the default
    collective timeout) runs on ``launch.shared_pool`` -- the pytest session's ranks, started
    once per session -- which ``close`` leaves open for their owner."""

    def __init__(self, shared: bool = False):
        self._pools: dict[tuple, WorkerPool] = {}
        self.shared = shared

    def get(self, case: CaseConfig) -> WorkerPool:
        run = case.run
        if self.shared and run.threads_per_rank == 1 and run.timeout_s == SHARED_TIMEOUT_S:
            return shared_pool(case.layout.world_size, run.device, run.timeout_s)
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
            pool = None if cls.isolated else pools.get(case)
            try:
                row = case_row(case, pool, suite, out_dir)
            except RankError as e:
                row = failed_row(suite, case, e)
            else:
                localise(case, row, None if cls.isolated else pools.get(case))
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
