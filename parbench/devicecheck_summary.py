"""The device check's summary (``python -m parbench.devicecheck summary``): what each step of
``scripts/device_check.sh`` did, the cases' verdicts, the device profile, and the step
predicted by the time model beside the step measured -- written to ``summary.json`` and
``summary.md`` under the check's directory and printed."""
from __future__ import annotations

import json
from pathlib import Path



def read_steps(out: Path) -> list[dict]:
    """``steps.tsv`` (name, status, exit code, seconds, note), as the script wrote it."""
    path = out / "steps.tsv"
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        name, status, rc, secs, note = (line.split("\t") + [""] * 5)[:5]
        rows.append({"name": name, "status": status, "rc": int(rc or 0),
                     "seconds": float(secs or 0), "note": note})
    return rows


def case_rows(out: Path) -> list[dict]:
    """Every case row the check's runs wrote (``single/``, ``multi/``)."""
    from .results.files import load_rows
    rows = []
    for part in ("single", "multi"):
        path = out / part / "results.jsonl"
        if not path.exists():
            continue
        for r in load_rows(path):
            peaks = [p for p in (r.memory.peak_bytes or []) if p is not None]
            rows.append({"part": part, "scheme": r.case.scheme,
                         "world": r.case.layout.world_size, "passed": bool(r.passed),
                         "status": r.verdict.status, "step_ms": (r.time.step_s or 0) * 1e3,
                         "peak_bytes": max(peaks) if peaks else None,
                         "golden": r.verdict.golden_source,
                         "first_failure": str(r.verdict.first_failure or "")})
    return rows


def _estimate(path: Path) -> dict | None:
    if not path.exists():
        return None
    try:
        d = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None
    t = d["time"]
    return {"profile": t["device"]["name"], "calibrated": t["device"]["calibrated"],
            "step_s": t["step_s"], "mfu": t["mfu"], "memory_bytes": t["memory_per_rank_bytes"],
            "flops": d["flops"]["per_device_training"],
            "peak_flops": t["device"]["matmul_TFLOPs"], "notes": t.get("notes", [])}


def comparison(out: Path, dtype: str) -> list[dict]:
    """The measured step against each prediction: step time, MFU (the model's FLOPs per
    step over the step and the profile's matmul peak of the step's dtype), memory."""
    step_path = out / "step.json"
    step = json.loads(step_path.read_text()) if step_path.exists() else {}
    measured = step.get("median_s")
    rows = []
    for which in ("calibrated", "preset"):
        est = _estimate(out / f"estimate-{which}.json")
        if est is None:
            continue
        peak = est["peak_flops"].get(dtype, 0) * 1e12
        rows.append({"prediction": which, "profile": est["profile"],
                     "predicted_s": est["step_s"], "measured_s": measured,
                     "ratio": est["step_s"] / measured if measured else None,
                     "predicted_mfu": est["mfu"],
                     "measured_mfu": est["flops"] / measured / peak if measured and peak
                     else None,
                     "predicted_memory_bytes": est["memory_bytes"],
                     "measured_peak_bytes": step.get("peak_bytes")})
    return rows


def profile_figures(out: Path) -> dict | None:
    """The calibrated profile's headline figures."""
    info = json.loads((out / "device.json").read_text()) if (out / "device.json").exists() \
        else {}
    path = Path(info.get("profile_path", ""))
    if not info or not path.is_file():
        return None
    d = json.loads(path.read_text())
    return {"path": str(path), "name": d["name"],
            "matmul_TFLOPs": {k: v / 1e12 for k, v in d["matmul_flops"].items()},
            "mem_bandwidth_GBs": d["mem_bandwidth"] / 1e9,
            "communication_from": d.get("meta", {}).get("communication_from", "measured"),
            "reference_step": d.get("meta", {}).get("reference_step")}


def verdict(steps: list[dict], rows: list[dict], multi_required: bool,
            expected: tuple) -> list[str]:
    """What failed: a required step of ``expected`` ((name, required) pairs) not ok or
    missing, a required case not passing."""
    bad = []
    status = {s["name"]: s["status"] for s in steps}
    for name, required in expected:
        required = multi_required if name == "multi" else required
        if required and status.get(name) != "ok":
            bad.append(f"step {name}: {status.get(name, 'did not run')}")
    for r in rows:
        if not r["passed"] and (r["part"] == "single" or multi_required):
            bad.append(f"case {r['scheme']} (world {r['world']}): {r['status']}, "
                       f"{r['first_failure'] or 'not equivalent'}")
    return bad


def _ms(x) -> str:
    return "-" if x is None else f"{x * 1e3:.2f} ms"


def _gib(x) -> str:
    return "-" if x is None else f"{x / 2 ** 30:.3f} GiB"


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def render(s: dict) -> str:
    """The summary as markdown."""
    lines = [f"# device check: {s['device']['name']} ({s['device']['kind']})", "",
             f"result: **{'PASS' if s['ok'] else 'FAIL'}**; multi-rank: "
             f"{s['device']['multi_rank']['why']}", "", "| step | status | s | note |",
             "|---|---|---|---|"]
    lines += [f"| {x['name']} | {x['status']} | {x['seconds']:.1f} | {x['note']} |"
              for x in s["steps"]]
    lines += ["", "| part | scheme | world | ok | ms/step | peak | golden |",
              "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['part']} | {r['scheme']} | {r['world']} | "
              f"{'pass' if r['passed'] else 'FAIL ' + r['status']} | {r['step_ms']:.2f} | "
              f"{_gib(r['peak_bytes'])} | {r['golden']} |" for r in s["cases"]]
    p = s.get("profile")
    if p:
        mm = ", ".join(f"{k} {v:.2f}" for k, v in p["matmul_TFLOPs"].items())
        lines += ["", f"profile `{p['path']}`: matmul {mm} TFLOP/s, memory "
                  f"{p['mem_bandwidth_GBs']:.1f} GB/s, communication: "
                  f"{p['communication_from']}"]
    flash = s["device"].get("flash_attention") or {}
    if flash:
        lines += ["", "SDPA's flash kernel for the reference model's attention: "
                  + "; ".join(f"{k}: {v}" for k, v in flash.items())]
    lines += ["", f"step model: {s['step_model']}", "",
              "| prediction | profile | predicted | measured | pred/meas | MFU pred | "
              "MFU meas | memory pred | peak meas |", "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {c['prediction']} | {c['profile']} | {_ms(c['predicted_s'])} | "
              f"{_ms(c['measured_s'])} | "
              f"{'-' if c['ratio'] is None else format(c['ratio'], '.2f')} | "
              f"{_pct(c['predicted_mfu'])} | {_pct(c['measured_mfu'])} | "
              f"{_gib(c['predicted_memory_bytes'])} | {_gib(c['measured_peak_bytes'])} |"
              for c in s["comparison"]]
    if s["failures"]:
        lines += ["", "failures:"] + [f"- {f}" for f in s["failures"]]
    return "\n".join(lines) + "\n"


def summarize(device: str, out: Path, expected: tuple, step_model: dict) -> int:
    """Write ``summary.json`` and ``summary.md`` under ``out``, print the markdown; 0 when
    every required step of ``expected`` ran and every required case passed, else 1."""
    info = json.loads((out / "device.json").read_text())
    steps = read_steps(out)
    rows = case_rows(out)
    multi_required = bool(info["multi_rank"]["required"])
    failures = verdict(steps, rows, multi_required, expected)
    summary = {"device": info, "ok": not failures, "steps": steps, "cases": rows,
               "profile": profile_figures(out), "step_model": step_model,
               "comparison": comparison(out, step_model["dtype"]),
               "failures": failures}
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    text = render(summary)
    (out / "summary.md").write_text(text)
    print(text, end="")
    return 0 if not failures else 1
