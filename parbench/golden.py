"""The golden run: the unpartitioned model trained on one device, and golden files.

``reference_run`` trains the whole reference model on the global batch of every step
(one forward over the whole batch, mean token cross-entropy) with the same seed, data and
optimizer as the schemes, keeping the loss, the gradients and the updated parameters of each
step. Golden files are safetensors plus a JSON manifest with sha256 digests; nothing is
pickled.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field

import torch

from .config import CaseConfig
from .model import build_model, make_optimizer, synthetic_batch
from .verdict import compare


@dataclass
class GoldenRun:
    losses: list[float] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    params: list[dict[str, torch.Tensor]] = field(default_factory=list)
    #: "live" (trained in this process) or "stored:<file>" (a committed golden file)
    source: str = "live"


def global_batch(case: CaseConfig, step: int):
    p = case.layout
    return synthetic_batch(case.model, p.global_batch_size, case.run.seed, step)


def _named(model) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in model.named_parameters()}


def routing_groups(case: CaseConfig):
    """The MoE routing groups the case's scheme routes (None for a dense model): the golden
    run routes the same groups (``parbench.moe``)."""
    if not case.model.num_experts:
        return None
    from .scheme import get_scheme
    return get_scheme(case.run.scheme).routing_groups(case)


def golden_key(case: CaseConfig, steps: int) -> str:
    """What a single-device reference run depends on: the model, the global batch, the seed,
    the optimizer and the number of steps (and, for an MoE model, the routing groups)."""
    from .config import ANALYTIC_ONLY_FIELDS
    d = case.to_dict()
    keep_run = {k: d["run"][k] for k in ("seed", "optimizer", "lr", "weight_decay", "beta1",
                                         "beta2", "eps")}
    # the estimate-only fields (a runnable case has them at their defaults) do not change the
    # reference model, so they stay out of the key
    model = {k: v for k, v in d["model"].items()
             if not (k in ANALYTIC_ONLY_FIELDS and v == ANALYTIC_ONLY_FIELDS[k])}
    parts = [model, case.layout.global_batch_size, keep_run, steps]
    routing = routing_groups(case)
    if routing is not None:
        parts.append(routing.key())
    return json.dumps(parts, sort_keys=True)


def golden_name(key: str) -> str:
    return "g-" + hashlib.sha1(key.encode()).hexdigest()[:12]


#: the committed golden files: <repository>/golden (absent in a non-editable install)
GOLDEN_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "golden")


def reference_run(case: CaseConfig, steps: int) -> GoldenRun:
    """The golden run of ``case``: the stored golden file when one was recorded for it with
    this torch version (its sha256 checked), else trained here ("live")."""
    key = golden_key(case, steps)
    if key not in _CACHE:
        if len(_CACHE) > 16:
            _CACHE.clear()
        _CACHE[key] = _stored(key, GOLDEN_DIR) or _train(case, steps)
    return _CACHE[key]


_CACHE: dict[str, GoldenRun] = {}


def _manifest(directory: str) -> dict:
    path = os.path.join(directory, "manifest.json")
    if not os.path.exists(path):
        return {}
    with open(path) as fh:
        return json.load(fh)


def _stored(key: str, directory: str) -> GoldenRun | None:
    name = golden_name(key)
    entry = _manifest(directory).get(name)
    if not entry or entry.get("key") != key or entry.get("torch") != torch.__version__:
        return None
    path = os.path.join(directory, entry["file"])
    if not os.path.exists(path) or _sha256(path) != entry["sha256"]:
        return None
    from safetensors.torch import load_file
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


def _train(case: CaseConfig, steps: int) -> GoldenRun:
    torch.manual_seed(case.run.seed)
    model = build_model(case.model, case.run.seed, routing_groups(case))
    opt = make_optimizer(model.parameters(), case.run)
    out = GoldenRun()
    for step in range(steps):
        x, y = global_batch(case, step)
        opt.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        out.losses.append(float(loss.detach()))
        out.grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        opt.step()
        out.params.append(_named(model))
    return out


# ---- golden files ---------------------------------------------------------------------------


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def record(cases: list[CaseConfig], directory: str) -> list[dict]:
    """Write the golden run of every distinct reference among ``cases`` (safetensors, one
    file each) and their manifest entries (key, sha256, steps, torch version)."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    manifest = _manifest(directory)
    written = []
    for case in cases:
        key = golden_key(case, case.run.steps)
        name = golden_name(key)
        if any(w["name"] == name for w in written):
            continue
        run = _train(case, case.run.steps)
        path = os.path.join(directory, f"{name}.safetensors")
        save_file(to_tensors(run), path)
        manifest[name] = {"file": f"{name}.safetensors", "sha256": _sha256(path),
                          "steps": case.run.steps, "key": key, "case": case.to_dict(),
                          "torch": torch.__version__}
        written.append({"name": name, **manifest[name]})
    with open(os.path.join(directory, "manifest.json"), "w") as fh:
        json.dump(manifest, fh, indent=2, sort_keys=True)
    return written


def check(directory: str, rtol: float = 1e-5, atol: float = 1e-6) -> list[dict]:
    """Each golden file against its manifest and against a fresh run: the sha256; tensors
    stored but no longer produced (and produced but not stored); the largest difference;
    and, when the file was recorded with another torch, whether that upgrade changed the
    numbers."""
    from safetensors.torch import load_file

    rows = []
    for name, entry in sorted(_manifest(directory).items()):
        path = os.path.join(directory, entry["file"])
        row = {"name": name, "file": entry["file"], "torch_recorded": entry.get("torch"),
               "torch_now": torch.__version__, "exists": os.path.exists(path)}
        if not row["exists"]:
            rows.append({**row, "sha256_ok": False, "match": False, "ok": False,
                         "max_abs": None, "stale": [], "new": []})
            continue
        row["sha256_ok"] = _sha256(path) == entry["sha256"]
        stored = load_file(path)
        fresh = to_tensors(_train(CaseConfig.from_dict(entry["case"]), entry["steps"]))
        row["stale"] = sorted(set(stored) - set(fresh))  # stored, no longer produced
        row["new"] = sorted(set(fresh) - set(stored))  # produced, not stored
        shared = {k: fresh[k] for k in fresh if k in stored}
        res = compare(shared, stored, rtol, atol)
        row.update({"max_abs": res["max_abs"], "match": res["ok"],
                    "bitwise": all(torch.equal(fresh[k], stored[k]) for k in shared)})
        row["torch_changed_numbers"] = (row["torch_recorded"] != row["torch_now"]
                                        and not row["bitwise"])
        row["ok"] = row["sha256_ok"] and row["match"] and not row["stale"] and not row["new"]
        rows.append(row)
    return rows
