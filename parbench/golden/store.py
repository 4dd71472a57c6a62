"""The golden run served from the committed golden files when one was recorded, and the
files themselves: safetensors plus a JSON manifest with sha256 digests; nothing is pickled."""
from __future__ import annotations

import hashlib
import json
import os
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

from ..config import CaseConfig
from ..model.moe import RoutingGroups
from ..verdict import compare
from .run import GoldenRun, golden_key, golden_name, key_routing, train

#: the committed golden files: <repository>/golden (absent in a non-editable install)
GOLDEN_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "golden")

_CACHE: dict[str, GoldenRun] = {}


def reference_run(case: CaseConfig, steps: int, routing: RoutingGroups | None = None
                  ) -> GoldenRun:
    """The golden run of ``case`` (an MoE model routing ``routing``): the stored golden file
    when one was recorded for it with this torch version (its sha256 checked), else trained
    here ("live")."""
    key = golden_key(case, steps, routing)
    if key not in _CACHE:
        if len(_CACHE) > 16:
            _CACHE.clear()
        _CACHE[key] = stored(key, GOLDEN_DIR) or train(case, steps, routing)
    return _CACHE[key]


def manifest(directory: str) -> dict:
    path = os.path.join(directory, "manifest.json")
    if not os.path.exists(path):
        return {}
    with open(path) as fh:
        return json.load(fh)


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def stored(key: str, directory: str) -> GoldenRun | None:
    """The golden run recorded under ``key`` in ``directory``, if intact and from this
    torch."""
    entry = manifest(directory).get(golden_name(key))
    if not entry or entry.get("key") != key or entry.get("torch") != torch.__version__:
        return None
    path = os.path.join(directory, entry["file"])
    if not os.path.exists(path) or sha256(path) != entry["sha256"]:
        return None
    run = from_tensors(load_file(path), entry["steps"])
    run.source = f"stored:{entry['file']}"
    return run


def to_tensors(run: GoldenRun) -> dict[str, torch.Tensor]:
    out = {}
    for s in range(len(run.losses)):
        out[f"loss/{s}"] = torch.tensor([run.losses[s]], dtype=torch.float64)
        out.update({f"grad/{s}/{n}": t.contiguous() for n, t in run.grads[s].items()})
        out.update({f"param/{s}/{n}": t.contiguous() for n, t in run.params[s].items()})
    return out


def from_tensors(tensors: dict[str, torch.Tensor], steps: int) -> GoldenRun:
    run = GoldenRun()
    for s in range(steps):
        run.losses.append(float(tensors[f"loss/{s}"].item()))
        run.grads.append({k.split("/", 2)[2]: t for k, t in tensors.items()
                          if k.startswith(f"grad/{s}/")})
        run.params.append({k.split("/", 2)[2]: t for k, t in tensors.items()
                           if k.startswith(f"param/{s}/")})
    return run


def record(cases: list[CaseConfig], directory: str,
           routing_of: Callable[[CaseConfig], RoutingGroups | None] = lambda case: None
           ) -> list[dict]:
    """Write the golden run of every distinct reference among ``cases`` (safetensors, one
    file each; ``routing_of(case)``: the routing groups of an MoE case's scheme) and their
    manifest entries (key, sha256, steps, torch version)."""
    os.makedirs(directory, exist_ok=True)
    entries = manifest(directory)
    written = []
    for case in cases:
        routing = routing_of(case)
        key = golden_key(case, case.run.steps, routing)
        name = golden_name(key)
        if any(w["name"] == name for w in written):
            continue
        path = os.path.join(directory, f"{name}.safetensors")
        save_file(to_tensors(train(case, case.run.steps, routing)), path)
        entries[name] = {"file": f"{name}.safetensors", "sha256": sha256(path),
                         "steps": case.run.steps, "key": key, "case": case.to_dict(),
                         "torch": torch.__version__}
        written.append({"name": name, **entries[name]})
    with open(os.path.join(directory, "manifest.json"), "w") as fh:
        json.dump(entries, fh, indent=2, sort_keys=True)
    return written


def check(directory: str, rtol: float = 1e-5, atol: float = 1e-6) -> list[dict]:
    """Each golden file against its manifest and against a fresh run (routing the groups its
    key names): the sha256; tensors stored but no longer produced (and produced but not
    stored); the largest difference; and, when the file was recorded with another torch,
    whether that upgrade changed the numbers."""
    return [_check_entry(directory, name, entry, rtol, atol)
            for name, entry in sorted(manifest(directory).items())]


def _check_entry(directory: str, name: str, entry: dict, rtol: float, atol: float) -> dict:
    path = os.path.join(directory, entry["file"])
    row = {"name": name, "file": entry["file"], "torch_recorded": entry.get("torch"),
           "torch_now": torch.__version__, "exists": os.path.exists(path)}
    if not row["exists"]:
        return {**row, "sha256_ok": False, "match": False, "ok": False, "max_abs": None,
                "stale": [], "new": []}
    row["sha256_ok"] = sha256(path) == entry["sha256"]
    saved = load_file(path)
    fresh = to_tensors(train(CaseConfig.from_dict(entry["case"]), entry["steps"],
                             key_routing(entry["key"])))
    row["stale"] = sorted(set(saved) - set(fresh))  # stored, no longer produced
    row["new"] = sorted(set(fresh) - set(saved))  # produced, not stored
    shared = {k: fresh[k] for k in fresh if k in saved}
    res = compare(shared, saved, rtol, atol)
    row.update({"max_abs": res["max_abs"], "match": res["ok"],
                "bitwise": all(torch.equal(fresh[k], saved[k]) for k in shared)})
    row["torch_changed_numbers"] = (row["torch_recorded"] != row["torch_now"]
                                    and not row["bitwise"])
    row["ok"] = row["sha256_ok"] and row["match"] and not row["stale"] and not row["new"]
    return row
