"""The golden run served from the committed golden files, and the files themselves.

A golden file holds a run's losses and the gradients of each of its steps (safetensors,
float32, nothing pickled); the parameters are not stored: replaying the run's optimizer on
the stored gradients from the seeded initialisation gives them exactly (``run.train``), so a
file costs one copy of the model per step. The manifest (``manifest.json``) names, for each
file, its key (``key.golden_key``), its sha256, its steps, its size, the torch release it was
recorded with and the suite cases that use it, and says how to re-record
(``parbench golden record``).

A run is served from a file when the key matches, the digest checks and the torch release
(the version without its local build tag: ``2.13.0+cpu`` and ``2.13.0`` are one release) is
the recording one; a request for more steps than the file holds is served by prefix and
trained on from there ("stored:<file>+live"). Anything else is trained here ("live").
"""
from __future__ import annotations

import hashlib
import json
import os

import torch
from safetensors.torch import load_file, save_file

from ..config import CaseConfig
from ..model.moe import RoutingGroups
from .key import KEY_FORMAT, golden_key, golden_name
from .run import GoldenRun, train
from .select import Wanted

#: the committed golden files: <repository>/golden (absent in a non-editable install)
GOLDEN_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "golden")
#: what the manifest says about re-recording
HOW_TO_RECORD = ("parbench golden record  (each suite's most shared golden key; keys=all: "
                 "every key; the directory then holds exactly what was recorded)")

#: key -> (the longest run served in this process, its stored file or None, stored steps)
_CACHE: dict[str, tuple[GoldenRun, str | None, int]] = {}


def torch_release(version: str | None = None) -> str:
    """``torch.__version__`` without its local build tag (``+cpu``, ``+cu128``)."""
    return (version or torch.__version__).split("+")[0]


def reference_run(case: CaseConfig, steps: int, routing: RoutingGroups | None = None
                  ) -> GoldenRun:
    """The golden run of ``case`` (an MoE model routing ``routing``) for ``steps`` steps:
    served from a golden file where one holds its key (module doc), else trained here."""
    key = golden_key(case, routing)
    if key in _CACHE and len(_CACHE[key][0].losses) >= steps:
        return _prefix(*_CACHE[key], steps)
    if len(_CACHE) > 16:
        _CACHE.clear()
    prefix = stored(key, GOLDEN_DIR)
    run = train(case, steps, routing, prefix)
    entry = (run, prefix.source.split(":", 1)[1] if prefix else None,
             len(prefix.losses) if prefix else 0)
    _CACHE[key] = entry
    return _prefix(*entry, steps)


def _prefix(run: GoldenRun, file: str | None, stored_steps: int, steps: int) -> GoldenRun:
    """The first ``steps`` steps of ``run``, saying where they came from."""
    source = ("live" if file is None else f"stored:{file}" if steps <= stored_steps
              else f"stored:{file}+live")
    return GoldenRun(run.losses[:steps], run.grads[:steps], run.params[:steps],
                     states=run.states[:steps], source=source)


def read_manifest(directory: str) -> dict:
    """The manifest's runs (name -> entry); empty when there is none or it is of another
    format."""
    path = os.path.join(directory, "manifest.json")
    if not os.path.exists(path):
        return {}
    with open(path) as fh:
        data = json.load(fh)
    return data.get("runs", {}) if data.get("format") == KEY_FORMAT else {}


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def stored(key: str, directory: str) -> GoldenRun | None:
    """The stored steps of the golden run ``key`` in ``directory`` (losses and gradients,
    no parameters), if its file is intact and was recorded with this torch release."""
    entry = read_manifest(directory).get(golden_name(key))
    if (not entry or entry.get("key") != key
            or torch_release(entry.get("torch")) != torch_release()):
        return None
    path = os.path.join(directory, entry["file"])
    if not os.path.exists(path) or sha256(path) != entry["sha256"]:
        return None
    run = from_tensors(load_file(path))
    run.source = f"stored:{entry['file']}"
    return run


def to_tensors(run: GoldenRun) -> dict[str, torch.Tensor]:
    """``loss`` (float64, one per step), ``grad/<step>/<name>`` and the model state after
    each step, ``state/<step>/<name>`` (the routers' balancing biases): what a file holds."""
    out = {"loss": torch.tensor(run.losses, dtype=torch.float64)}
    for s, grads in enumerate(run.grads):
        out.update({f"grad/{s}/{n}": t.contiguous() for n, t in grads.items()})
    for s, state in enumerate(run.states):
        out.update({f"state/{s}/{n}": t.contiguous() for n, t in state.items()})
    return out


def from_tensors(tensors: dict[str, torch.Tensor]) -> GoldenRun:
    """The losses and gradients of a file's tensors (``to_tensors``); no parameters."""
    run = GoldenRun(losses=[float(v) for v in tensors["loss"].tolist()])
    run.grads = [{} for _ in run.losses]
    run.states = [{} for _ in run.losses]
    for k, t in tensors.items():
        kind, _, rest = k.partition("/")
        if kind in ("grad", "state"):
            s, name = rest.split("/", 1)
            (run.grads if kind == "grad" else run.states)[int(s)][name] = t
    return run


def record(wanted: list[Wanted], directory: str) -> list[dict]:
    """Write the golden run of each of ``wanted`` (``select.select_runs``) and a manifest of
    exactly those runs; golden files of ``directory`` that it does not name are removed."""
    os.makedirs(directory, exist_ok=True)
    runs = {}
    for w in wanted:
        name = golden_name(w.key)
        path = os.path.join(directory, f"{name}.safetensors")
        save_file(to_tensors(train(w.case, w.steps, w.routing)), path)
        runs[name] = {"file": f"{name}.safetensors", "sha256": sha256(path),
                      "bytes": os.path.getsize(path), "steps": w.steps, "key": w.key,
                      "torch": torch.__version__, "cases": list(w.cases)}
    for f in os.listdir(directory):
        if f.startswith("g-") and f.endswith(".safetensors") and f[:-12] not in runs:
            os.remove(os.path.join(directory, f))
    with open(os.path.join(directory, "manifest.json"), "w") as fh:
        json.dump({"format": KEY_FORMAT, "record": HOW_TO_RECORD, "runs": runs}, fh,
                  indent=1, sort_keys=True)
        fh.write("\n")
    return [{"name": n, **e} for n, e in sorted(runs.items())]
