"""The time model against measurement: every 2-rank case of the data, pipeline, tensor and
sequence suites, run on local gloo ranks (one thread each) and predicted from the calibrated
profile of this machine.

    python scripts/validate_timemodel.py [profile=cpu-local] [calibrate=auto|true|false]
        [repeats=3] [timed_steps=7] [suites=data,pipeline,tensor,sequence] [native=false]
        [tolerance=0.15] [spearman=0.8] [only=SCHEME,...] [out=FILE.json] [reuse=FILE.json]
        [instrument=false]

``calibrate=auto`` (default) runs ``parbench calibrate`` first, at the suites' shapes, unless
the profile exists; ``true`` always. Each case runs ``repeats`` times, the cases interleaved
(drift of a shared machine hits them all); its measured step time is the median over the
repeats of the harness's median step (slowest rank, timed steps after the warm-up). The table
gives measured, predicted, the error and whether it is within ``tolerance``; then the
Spearman rank correlation of predicted against measured over all cases, and over the native
schemes. Exit 0 when every case is within the tolerance and Spearman >= ``spearman``, 1
otherwise (each miss listed), 2 on bad input. ``reuse=FILE.json`` predicts again against the
measurements an earlier run wrote with ``out=`` (nothing is run).

The cases run with ``instrument=false`` by default: the time model predicts the training
step, not parbench's own ledger and timeline (``instrument=true`` runs them as the suites do,
and calibrates the collectives inside the ledger too; ``scripts/bench_overhead.py`` measures
the difference). Everything else is the suites' configuration.

What the model is told about each case is what the case's configuration says -- degrees,
micro-batches, dtype, recomputation, the schedule, the context-parallel algorithm, the ZeRO
stage and the bucket size -- never anything measured from the case itself. Baselines (torch
DDP, FSDP2, DeepSpeed, DTensor, Megatron-Core, torch.distributed.pipelining) are predicted as
the algorithm they implement; their own framework overheads are not in the model, so they
are reported apart.
"""
from __future__ import annotations

import json
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parbench.analytic.data_parallel import layer_tensors  # noqa: E402
from parbench.analytic.shape import shape_from  # noqa: E402
from parbench.calibration import Plan, calibrate, compute_task, run_everywhere  # noqa: E402
from parbench.config import ConfigError  # noqa: E402
from parbench.launch import RankError  # noqa: E402
from parbench.overrides import apply_overrides, coerce, parse_overrides  # noqa: E402
from parbench.registry import get_scheme  # noqa: E402
from parbench.runner import PoolCache, case_row  # noqa: E402
from parbench.suites import load_suite  # noqa: E402
from parbench.timemodel import Training, load_profile, predict_step  # noqa: E402
from parbench.timemodel.profile import profile_dir  # noqa: E402
from parbench.terminate import run_terminable  # noqa: E402
from validation_stats import repeatability, spearman  # noqa: E402  (scripts/)

SUITES = ("data", "pipeline", "tensor", "sequence")
#: schemes whose mechanism the time model does not price (said in the table, not predicted)
NOT_MODELLED = {
    "pipeline.bpipe": "BPipe's activation evict/load transfers are not in the time model",
    "pipeline.seq1f1b": "token-slice units (K/V cache per slice) are not in the time model",
    "pipeline.terapipe": "token-slice units (K/V cache per slice) are not in the time model",
    "context.distflashattn": "DistFlashAttn's helper schedule is not in the time model",
    "context.loongtrain": "the double ring is not in the time model",
    "context.loongtrain-cf": "the double ring is not in the time model",
}
TORCH_PIPE = {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved": "interleaved", "zbv": "zbv",
              "dualpipev": "dualpipev", "zb-interleaved": "zb-h1"}


# ---------------------------------------------------------------------------------------
# a case -> what the model is told
# ---------------------------------------------------------------------------------------

def layout_of(case):
    """The :class:`Layout` a case's configuration describes, and a note (None: not modelled)."""
    p, o, r = case.layout, case.options, case.run
    s = r.scheme
    kw = dict(**p.degrees(), vpp=p.vpp, sp=o.tensor.sp,
              micro_batch_size=p.micro_batch_size, num_microbatches=p.num_microbatches,
              first_stage_layers=p.first_stage_layers, last_stage_layers=p.last_stage_layers,
              dtype=r.dtype, recompute=o.recompute, bucket_mb=o.data.bucket_mb,
              optimizer=r.optimizer)
    note = ""
    fam = s.split(".")[0]
    if s in ("data.ddp", "baseline.torch.ddp"):
        kw.update(zero_stage=0)
    elif s.startswith("zero."):
        kw.update(zero_stage=int(s.split(".")[1]))
    elif s.startswith("baseline.deepspeed.zero"):
        kw.update(zero_stage=int(s[-1]))
        note = "DeepSpeed's own traffic pattern differs (CPU-NOTES)"
    elif s == "baseline.torch.fsdp2":
        kw.update(zero_stage=3)
    elif s == "data.local_sgd":
        kw.update(zero_stage=0, bucket_mb=math.inf, overlap_grad_reduce=False)
        note = "averaging step every H steps"
    elif s in NOT_MODELLED:
        return None, NOT_MODELLED[s]
    elif s.startswith("pipeline."):
        kw.update(schedule=s.split(".", 1)[1])
    elif s.startswith("baseline.torch.pipelining."):
        kw.update(schedule=TORCH_PIPE.get(s.rsplit(".", 1)[1], "1f1b"))
    elif s == "baseline.deepspeed.pipe":
        kw.update(schedule="1f1b")
    elif s.startswith("tensor.megatron"):
        kw.update(sp=s.endswith("-sp"))
    elif s in ("baseline.dtensor.sp", "baseline.megatron.sp"):
        kw.update(sp=True)
    elif s in ("baseline.dtensor.tp", "baseline.megatron.tp"):
        kw.update(sp=False)
    elif fam == "context":
        kind = s.split(".", 1)[1]  # the scheme's name is its cp_algorithm
        u = o.context.cp_ulysses
        kw.update(cp_algorithm=kind, cp_ulysses=u, bucket_mb=math.inf,
                  overlap_grad_reduce=False)
        if kind == "usp" and u == p.cp:
            kw.update(cp_algorithm="ulysses")
    elif s == "baseline.deepspeed.ulysses":
        kw.update(cp_algorithm="ulysses", bucket_mb=math.inf, overlap_grad_reduce=False)
    elif s == "baseline.torch.context_parallel":
        kw.update(cp_algorithm="ring-attention", bucket_mb=math.inf)
    else:
        return None, f"scheme {s} not modelled"
    if kw["dp"] * kw["cp"] == 1:
        kw["zero_stage"] = 0
    return Training.of(**kw), note


def predict(case, profile) -> float:
    lay, _ = layout_of(case)
    shape = shape_from(case.model)
    st = predict_step(shape, lay, profile)
    if case.run.scheme == "data.local_sgd":
        # one averaging all-reduce of the fp32 parameters every H steps; the timed steps
        # are the run's last ones, so the fraction of them that average is counted exactly
        H = case.options.data.local_sgd_period  # noqa: N806
        r = case.run
        timed = range(r.steps + r.warmup_steps, r.steps + r.timed_steps)
        frac = sum(1 for s in timed if (s + 1) % H == 0) / max(len(timed), 1)
        alone = predict_step(shape, lay.with_values(dp=1), profile)
        psi = sum(x for _, ts in layer_tensors(shape) for x in ts)
        avg = profile.collective_time("all_reduce", case.layout.dp, 4 * psi, "intra")
        loss = profile.collective_time("all_reduce", case.layout.dp, 8, "intra")
        return alone.step_s + frac * avg + loss
    return st.step_s


# ---------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------

def label(case) -> str:
    p, o, r = case.layout, case.options, case.run
    deg = " ".join(f"{k}{n}" for k, n in p.degrees().items() if n > 1 and k != "ep")
    opts = []
    if p.vpp > 1:
        opts.append(f"v{p.vpp}")
    if o.recompute != "none":
        opts.append(f"rc={o.recompute}")
    if r.dtype != "fp32":
        opts.append(r.dtype)
    if o.context.cp_ulysses > 1:
        opts.append(f"u{o.context.cp_ulysses}")
    return f"{r.scheme} {deg}" + (f" [{', '.join(opts)}]" if opts else "")


def two_rank_cases(suites, timed_steps: int | None, instrument: bool = False):
    seen, out = set(), []
    for name in suites:
        for c in load_suite(name).cases:
            if c.layout.world_size != 2:
                continue
            ov = {"instrument": str(instrument).lower()}
            if timed_steps is not None:
                ov["timed_steps"] = timed_steps
            c = apply_overrides(c, ov)
            if c.id in seen:
                continue
            seen.add(c.id)
            out.append((name, c))
    return out


def shapes_of(cases):
    return list(dict.fromkeys(shape_from(c.model) for _, c in cases))  # distinct, in order


def ensure_profile(name: str, mode: str, cases, instrument: bool = False):
    path = profile_dir() / f"{name}.json"
    if mode == "false" or (mode == "auto" and (path.exists() or name.endswith(".json"))):
        return load_profile(name)
    shapes = shapes_of(cases)
    mbs = tuple(sorted({c.layout.micro_batch_size for _, c in cases}))
    print(f"calibrating {name} at the suites' shapes ({len(shapes)} model shapes, "
          f"micro-batches {mbs}) ...", flush=True)
    dtypes = tuple(sorted({c.run.dtype for _, c in cases}, key=lambda d: d != "fp32"))
    plan = Plan(device="cpu", shape=shapes[0], micro_batch_sizes=mbs, tp_splits=(1, 2),
                cp_splits=(1, 2), dtypes=dtypes, instrumented=instrument)
    prof = calibrate(plan, 2, name, reference=("tiny", 2, 2),
                     progress=lambda s: print("  " + s, flush=True))
    for sh in shapes[1:]:
        p2 = Plan(device="cpu", shape=sh, micro_batch_sizes=mbs, tp_splits=(1, 2),
                  cp_splits=(1, 2), square_sizes=(), dtypes=dtypes)
        res = run_everywhere(compute_task, 2, "cpu", p2)
        keys = {prof._part_key(p["kind"], p) for p in prof.parts}
        for r in res:
            for p in r.get("parts", []):
                k = prof._part_key(p["kind"], p)
                if k not in keys:
                    prof.parts.append(p)
                    keys.add(k)
            have = {(g["m"], g["n"], g["k"], g["dtype"]) for g in prof.gemms}
            prof.gemms += [g for g in r["gemms"]
                           if (g["m"], g["n"], g["k"], g["dtype"]) not in have]
            prof.attention += [a for a in r["attention"] if a not in prof.attention]
    prof.__post_init__()
    prof.save(path)
    print(f"saved {path}", flush=True)
    return prof


def run_cases(cases, repeats: int):
    """Every case ``repeats`` times, interleaved, on one pool per world size."""
    times: dict[str, list[float]] = {c.id: [] for _, c in cases}
    failures: dict[str, str] = {}
    pools = PoolCache()
    try:
        for rep in range(repeats):
            for i, (_, c) in enumerate(cases):
                if c.id in failures:
                    continue
                cls = get_scheme(c.run.scheme)
                try:
                    cls.check(c)
                    row = case_row(c, None if cls.isolated else pools.get(c))
                except (RankError, ConfigError) as e:
                    failures[c.id] = str(e).splitlines()[0][:120]
                    continue
                v, step_s = row.verdict, row.time.step_s
                if v.status != "ok" or not step_s:
                    failures[c.id] = (v.failure.message if v.failure else str(v.status))[:120]
                    continue
                times[c.id].append(step_s)
                print(f"  repeat {rep + 1}/{repeats} [{i + 1}/{len(cases)}] {label(c):48s} "
                      f"{step_s * 1e3:8.2f} ms", flush=True)
    finally:
        pools.close()
    return times, failures


def reused_measurements(reuse: str, modelled: list) -> tuple[dict, dict, dict]:
    """The measurements of an earlier run (its out= file), to predict again against them;
    matched by id, else by suite and label when that pair is unique (an id carries a digest
    of every field, which changes when a field is added to the configuration; labels repeat
    where cases differ in a field the label does not show)."""
    meta_old = json.loads(Path(reuse).read_text())
    by_id = {r["id"]: r for r in meta_old["rows"]}
    pairs = [(r["suite"], r["case"]) for r in meta_old["rows"]]
    rows_old = {(r["suite"], r["case"]): r for r in meta_old["rows"]
                if pairs.count((r["suite"], r["case"])) == 1}
    old = {c.id: by_id.get(c.id) or rows_old.get((s, label(c))) for s, c in modelled}
    old = {cid: r for cid, r in old.items() if r is not None}
    measured = {cid: r["repeats_s"] for cid, r in old.items()}
    failures = {cid: r["note"] for cid, r in old.items() if not r["repeats_s"]}
    return measured, failures, meta_old


def prediction_rows(modelled: list, measured: dict, failures: dict, prof, tol: float) -> list:
    """One row per case: the median measured step beside the time model's prediction."""
    rows = []
    for suite, c in modelled:
        ts = measured.get(c.id) or []
        pred = predict(c, prof)
        meas = statistics.median(ts) if ts else None
        err = pred / meas - 1 if meas else None
        rows.append({"suite": suite, "case": label(c), "scheme": c.run.scheme, "id": c.id,
                     "baseline": c.run.scheme.startswith("baseline."),
                     "measured_s": meas, "repeats_s": ts, "predicted_s": pred, "error": err,
                     "ok": err is not None and abs(err) <= tol,
                     "note": failures.get(c.id) or layout_of(c)[1]})
    return rows


def main(argv: list[str]) -> int:
    import os
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ov = parse_overrides(argv)
    name = ov.pop("profile", "cpu-local")
    mode = ov.pop("calibrate", "auto")
    if mode not in ("auto", "true", "false"):
        raise ConfigError(f"calibrate={mode!r} must be auto, true or false")
    repeats = coerce(ov.pop("repeats", "3"), int, "repeats")
    timed = coerce(ov.pop("timed_steps", "7"), int, "timed_steps")
    suites = tuple(ov.pop("suites", ",".join(SUITES)).split(","))
    native_only = coerce(ov.pop("native", "false"), bool, "native")
    tol = coerce(ov.pop("tolerance", "0.15"), float, "tolerance")
    rho_min = coerce(ov.pop("spearman", "0.8"), float, "spearman")
    out = ov.pop("out", None)
    only = ov.pop("only", None)
    reuse = ov.pop("reuse", None)
    instrument = coerce(ov.pop("instrument", "false"), bool, "instrument")
    if ov:
        raise ConfigError(f"unknown key {sorted(ov)[0]!r} (profile=, calibrate=, repeats=, "
                          "timed_steps=, suites=, native=, tolerance=, spearman=, only=, out=, "
                          "reuse=, instrument=)")
    cases = two_rank_cases(suites, timed, instrument)
    if native_only:
        cases = [(s, c) for s, c in cases if not c.run.scheme.startswith("baseline.")]
    if only:
        keys = only.split(",")
        cases = [(s, c) for s, c in cases if any(k in c.run.scheme for k in keys)]
    modelled = []
    for s, c in cases:
        lay, note = layout_of(c)
        if lay is None:
            print(f"skipped {label(c)}: {note}")
            continue
        modelled.append((s, c))
    prof = ensure_profile(name, mode, modelled, instrument)
    load = os.getloadavg()
    started = time.time()
    if reuse:
        print(f"predicting {len(modelled)} two-rank cases against the measurements in {reuse}")
    else:
        print(f"running {len(modelled)} two-rank cases x {repeats} repeats (timed_steps={timed}; "
              f"load average {load[0]:.2f} on {os.cpu_count()} cores) ...", flush=True)
    if reuse:
        measured, failures, meta_old = reused_measurements(reuse, modelled)
        load = meta_old.get("load_average_start", load)
        repeats = meta_old.get("repeats", repeats)
        started -= meta_old.get("seconds", 0.0)
    else:
        measured, failures = run_cases(modelled, repeats)
    rows = prediction_rows(modelled, measured, failures, prof, tol)
    load_end = os.getloadavg() if not reuse else meta_old.get("load_average_end", load)
    return report(rows, prof, tol, rho_min, out,
                  {"load_average_start": load, "load_average_end": load_end,
                   "seconds": time.time() - started, "repeats": repeats, "timed_steps": timed})


def report(rows, prof, tol, rho_min, out, meta) -> int:
    print()
    print(f"profile {prof.name} ({'calibrated' if prof.calibrated else 'preset'}; "
          f"{prof.source})")
    hdr = f"{'suite':8s} {'case':52s} {'measured':>10s} {'predicted':>10s} {'error':>8s}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        m = f"{r['measured_s'] * 1e3:8.2f}ms" if r["measured_s"] else "      --  "
        e = f"{100 * r['error']:+7.1f}%" if r["error"] is not None else "     -- "
        flag = "" if r["ok"] else "  MISS"
        print(f"{r['suite']:8s} {r['case'][:52]:52s} {m:>10s} {r['predicted_s'] * 1e3:8.2f}ms "
              f"{e}{flag}" + (f"  ({r['note']})" if r["note"] and not r["ok"] else ""))
    have = [r for r in rows if r["measured_s"]]
    rho = spearman([r["measured_s"] for r in have], [r["predicted_s"] for r in have])
    nat = [r for r in have if not r["baseline"]]
    rho_n = spearman([r["measured_s"] for r in nat], [r["predicted_s"] for r in nat])
    within = sum(r["ok"] for r in have)
    within_n = sum(r["ok"] for r in nat)
    abs_err = [abs(r["error"]) for r in have]
    print()
    print(f"within {100 * tol:.0f}%: {within} of {len(have)} cases "
          f"({within_n} of {len(nat)} native); median |error| "
          f"{100 * statistics.median(abs_err):.1f}%" if abs_err else "no measurements")
    rep_in, rep_n = repeatability(nat, tol)
    if rep_n:
        print(f"repeatability: one repeat within {100 * tol:.0f}% of the mean of the case's "
              f"other repeats in {rep_in} of {rep_n} ({100 * rep_in / rep_n:.0f}%, native "
              "cases): the measurement's own scatter")
    print(f"Spearman rank correlation, predicted vs measured: {rho:.3f} over {len(have)} "
          f"configurations ({rho_n:.3f} over the {len(nat)} native ones); target >= {rho_min}")
    print(f"load average {meta['load_average_start'][0]:.2f} at the start, "
          f"{meta['load_average_end'][0]:.2f} at the end "
          f"({meta['seconds']:.0f} s, {meta['repeats']} repeats)")
    misses = [r for r in rows if not r["ok"]]
    ok = not misses and rho >= rho_min and len(have) >= 12
    if out:
        Path(out).write_text(json.dumps({"rows": rows, "spearman": rho,
                                         "repeatability": [rep_in, rep_n],
                                         "spearman_native": rho_n, "tolerance": tol,
                                         "profile": prof.summary(), **meta}, indent=2,
                                        default=str))
    if not ok:
        for r in misses:
            why = f"error {100 * r['error']:+.1f}%" if r["error"] is not None else \
                f"not measured: {r['note']}"
            print(f"miss: {r['case']}: {why}", file=sys.stderr)
        if rho < rho_min:
            print(f"miss: Spearman {rho:.3f} < {rho_min}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    try:
        sys.exit(run_terminable(main, sys.argv[1:], prog="validate_timemodel",
                                kept="the lines printed above are what it measured"))
    except ConfigError as e:
        print(f"validate_timemodel: error: {e}", file=sys.stderr)
        sys.exit(2)
