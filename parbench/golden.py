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


@dataclass
class GoldenRun:
    losses: list[float] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    params: list[dict[str, torch.Tensor]] = field(default_factory=list)


def global_batch(case: CaseConfig, step: int):
    p = case.parallel
    return synthetic_batch(case.model, p.global_batch_size, case.run.seed, step)


def _named(model) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in model.named_parameters()}


def _key(case: CaseConfig, steps: int) -> str:
    d = case.to_dict()
    d.pop("id", None)
    keep_par = {k: d["parallel"][k] for k in ("micro_batch_size", "num_microbatches", "dp")}
    keep_run = {k: d["run"][k] for k in ("seed", "optimizer", "lr", "weight_decay", "beta1",
                                         "beta2", "eps")}
    return json.dumps([d["model"], keep_par, keep_run, steps], sort_keys=True)


def reference_run(case: CaseConfig, steps: int) -> GoldenRun:
    return _reference_cached(_key(case, steps), case, steps)


_CACHE: dict[str, GoldenRun] = {}


def _reference_cached(key: str, case: CaseConfig, steps: int) -> GoldenRun:
    if key not in _CACHE:
        if len(_CACHE) > 16:
            _CACHE.clear()
        _CACHE[key] = _train(case, steps)
    return _CACHE[key]


def _train(case: CaseConfig, steps: int) -> GoldenRun:
    torch.manual_seed(case.run.seed)
    model = build_model(case.model, case.run.seed)
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


# ---- comparisons ----------------------------------------------------------------------------


def compare(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], rtol: float,
            atol: float) -> dict:
    """Max |difference| and pass/fail over the names in ``ours``.

    The criterion is tensor-wise: max|a - b| <= atol + rtol * max|b| for each tensor. fp32
    reduction-order noise scales with the magnitude of the summed terms, i.e. with the
    tensor's scale rather than each element's (an element where terms cancel to ~0 carries
    the noise of its large addends), so an elementwise rtol would reject correct runs.
    """
    max_abs, ok, missing = 0.0, True, []
    for name, t in ours.items():
        if name not in ref:
            missing.append(name)
            ok = False
            continue
        a = t.detach().to(torch.float64).cpu()
        b = ref[name].detach().to(torch.float64).cpu()
        if a.shape != b.shape:
            raise ValueError(f"{name}: shape {tuple(a.shape)} != golden {tuple(b.shape)}")
        if not a.numel():
            continue
        d = float((a - b).abs().max())
        max_abs = max(max_abs, d)
        if not d <= atol + rtol * float(b.abs().max()):
            ok = False
    return {"max_abs": max_abs, "ok": ok, "missing": missing, "names": sorted(ours)}


# ---- golden files ---------------------------------------------------------------------------


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def record(case: CaseConfig, steps: int, directory: str, name: str) -> dict:
    """Write the golden run of ``case`` as ``name.safetensors`` and update the manifest."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    run = reference_run(case, steps)
    tensors = {}
    for s in range(steps):
        tensors[f"loss/{s}"] = torch.tensor([run.losses[s]], dtype=torch.float64)
        for n, t in run.grads[s].items():
            tensors[f"grad/{s}/{n}"] = t.contiguous()
        for n, t in run.params[s].items():
            tensors[f"param/{s}/{n}"] = t.contiguous()
    path = os.path.join(directory, f"{name}.safetensors")
    save_file(tensors, path)
    manifest_path = os.path.join(directory, "manifest.json")
    manifest = {}
    if os.path.exists(manifest_path):
        with open(manifest_path) as fh:
            manifest = json.load(fh)
    manifest[name] = {"file": f"{name}.safetensors", "sha256": _sha256(path), "steps": steps,
                      "case": case.to_dict(), "torch": torch.__version__}
    with open(manifest_path, "w") as fh:
        json.dump(manifest, fh, indent=2, sort_keys=True)
    return manifest[name]


def check(directory: str, rtol: float = 1e-5, atol: float = 1e-6) -> list[dict]:
    """Verify each golden file's sha256 and that a fresh reference run still matches it."""
    from safetensors.torch import load_file

    with open(os.path.join(directory, "manifest.json")) as fh:
        manifest = json.load(fh)
    out = []
    for name, entry in sorted(manifest.items()):
        path = os.path.join(directory, entry["file"])
        row = {"name": name, "sha256_ok": _sha256(path) == entry["sha256"]}
        stored = load_file(path)
        run = reference_run(CaseConfig.from_dict(entry["case"]), entry["steps"])
        worst, ok = 0.0, True
        for s in range(entry["steps"]):
            fresh = {f"grad/{s}/{n}": t for n, t in run.grads[s].items()}
            fresh.update({f"param/{s}/{n}": t for n, t in run.params[s].items()})
            fresh[f"loss/{s}"] = torch.tensor([run.losses[s]], dtype=torch.float64)
            res = compare(fresh, stored, rtol, atol)
            worst = max(worst, res["max_abs"])
            ok = ok and res["ok"]
        row.update({"max_abs": worst, "match": ok, "ok": ok and row["sha256_ok"]})
        out.append(row)
    return out
