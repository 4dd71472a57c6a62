"""``parbench golden check``: each golden file recomputed here and held to the verdict's own
noise rule.

A stored run and the same run recomputed on another CPU (another SIMD path), with other
threads or with another torch build differ by reduction order only, and the verdict already
says how far that noise goes (``RunConfig``; ``verdict.checks.compare``, tensor-wise
``max|fresh - stored| <= atol + rtol max|stored|``):

- losses, and the gradients of step 0 (identical weights): rtol 1e-5, atol 1e-6;
- the gradients of later steps and every step's parameters: rtol 1e-5, ``param_atol`` 1e-4,
  because AdamW's update lr m / (sqrt(v) + eps) turns a reduction-order difference d in a
  gradient near eps into a parameter difference of up to lr d / eps.

Seen on one torch (2.13): step-0 gradients 5.6e-8 and parameters 2.6e-6 apart between two
CPUs -- inside this rule, outside a flat atol of 1e-6 on everything (issue 20, section 6).
What the rule does catch is a change of the reference numbers themselves: a torch upgrade, or
a change to the model, the data or the optimizer that moves a loss or a gradient by more than
reduction noise. The run is rebuilt from its key with today's defaults
(``key.case_of_key``), so a changed default is caught too. The tolerances are the run's
(``RunConfig``'s defaults unless the key sets them).
"""
from __future__ import annotations

import os

import torch
from safetensors.torch import load_file

from ..verdict import compare
from .key import case_of_key
from .run import GoldenRun, train
from .store import from_tensors, read_manifest, sha256, to_tensors, torch_release


def check(directory: str) -> list[dict]:
    """One row per golden file of ``directory``'s manifest (``check_entry``)."""
    return [check_entry(directory, name, entry)
            for name, entry in sorted(read_manifest(directory).items())]


def check_entry(directory: str, name: str, entry: dict) -> dict:
    """The file against its manifest (it exists, its sha256) and against a fresh run of its
    key (the same tensors; within the noise rule, module doc; bitwise or not)."""
    path = os.path.join(directory, entry["file"])
    row = {"name": name, "file": entry["file"], "steps": entry["steps"],
           "torch_recorded": entry.get("torch"), "torch_now": torch.__version__,
           "exists": os.path.exists(path), "sha256_ok": False, "stale": [], "new": [],
           "worst": None, "bitwise": False, "ok": False}
    if not row["exists"]:
        return row
    row["sha256_ok"] = sha256(path) == entry["sha256"]
    saved = load_file(path)
    case, routing = case_of_key(entry["key"])
    fresh = train(case, entry["steps"], routing)
    fresh_tensors = to_tensors(fresh)
    row["stale"] = sorted(set(saved) - set(fresh_tensors))  # stored, no longer produced
    row["new"] = sorted(set(fresh_tensors) - set(saved))  # produced, not stored
    if row["stale"] or row["new"]:
        return row
    row["bitwise"] = all(torch.equal(fresh_tensors[k], saved[k]) for k in saved)
    replayed = train(case, entry["steps"], routing, from_tensors(saved))
    row["quantities"] = compare_runs(fresh, replayed, case.run)
    failing = [q for q in row["quantities"].values() if not q["ok"]]
    row["worst"] = max(failing, key=lambda q: q["excess"]) if failing else None
    row["ok"] = row["sha256_ok"] and not failing
    row["torch_changed_numbers"] = (torch_release(row["torch_recorded"]) != torch_release()
                                    and not row["bitwise"])
    return row


def compare_runs(fresh: GoldenRun, stored: GoldenRun, run) -> dict[str, dict]:
    """Largest difference per quantity (losses, step-0 gradients, later gradients,
    parameters) against its tolerance (module doc): ``max_abs``, ``tensor``, ``tolerance``,
    ``excess`` (max_abs / tolerance of the worst tensor), ``ok``."""
    out = {"losses": _losses(fresh.losses, stored.losses, run)}
    groups = {"step-0 gradients": (fresh.grads[:1], stored.grads[:1], run.atol),
              "later gradients": (fresh.grads[1:], stored.grads[1:], run.param_atol),
              "parameters": (fresh.params, stored.params, run.param_atol)}
    for what, (ours, ref, atol) in groups.items():
        worst = {"what": what, "max_abs": 0.0, "tensor": None, "tolerance": None,
                 "excess": 0.0, "ok": True}
        for step, (a, b) in enumerate(zip(ours, ref)):
            res = compare(a, b, run.rtol, atol)  # the verdict's rule decides
            worst["max_abs"] = max(worst["max_abs"], res["max_abs"])
            w = _nearest(a, b, run.rtol, atol)
            if w and w["max_abs"] / w["tolerance"] >= worst["excess"]:
                worst.update(tensor=f"step {step}: {w['tensor']}", tolerance=w["tolerance"],
                             excess=w["max_abs"] / w["tolerance"])
            worst["ok"] = worst["ok"] and res["ok"] and not res["missing"]
        out[what] = worst
    return out


def _losses(fresh: list[float], stored: list[float], run) -> dict:
    worst = {"what": "losses", "max_abs": 0.0, "tensor": None, "tolerance": None,
             "excess": 0.0, "ok": True}
    for step, (a, b) in enumerate(zip(fresh, stored)):
        d, tol = abs(a - b), run.atol + run.rtol * abs(b)
        worst["max_abs"] = max(worst["max_abs"], d)
        if d / tol >= worst["excess"]:
            worst.update(tensor=f"step {step}", tolerance=tol, excess=d / tol)
        worst["ok"] = worst["ok"] and d <= tol
    return worst


def _nearest(ours: dict, ref: dict, rtol: float, atol: float) -> dict | None:
    """The tensor nearest its tolerance (furthest past it when one fails), for the report."""
    best = None
    for n, t in ours.items():
        if n not in ref or not t.numel():
            continue
        d = float((t.double() - ref[n].double()).abs().max())
        tol = atol + rtol * float(ref[n].double().abs().max())
        if best is None or d / tol > best["max_abs"] / best["tolerance"]:
            best = {"tensor": n, "max_abs": d, "tolerance": tol}
    return best
