"""Golden files: recorded, used when present (and intact, and from this torch), checked."""
from __future__ import annotations

import json

import torch
from safetensors.torch import load_file, save_file

from parbench import golden
from parbench.config import CaseConfig
from parbench.overrides import apply_overrides


def tiny_case():
    return apply_overrides(CaseConfig(), {"model": "tiny", "dp": "2", "steps": "2"})


def test_stored_golden_is_used_and_equals_the_live_run(tmp_path):
    case = tiny_case()
    (entry,) = golden.record([case, case], str(tmp_path))  # one file per distinct reference
    key = golden.golden_key(case, 2)
    stored = golden.stored(key, str(tmp_path))
    live = golden.train(case, 2)
    assert stored is not None and stored.source == f"stored:{entry['file']}"
    assert stored.losses == live.losses
    for s in range(2):
        for n, t in live.params[s].items():
            assert torch.equal(stored.params[s][n], t)


def test_a_tampered_or_foreign_golden_is_not_used(tmp_path):
    case = tiny_case()
    (entry,) = golden.record([case], str(tmp_path))
    key = golden.golden_key(case, 2)
    manifest = tmp_path / "manifest.json"
    data = json.loads(manifest.read_text())
    data[entry["name"]]["torch"] = "0.0.0"  # recorded with another torch
    manifest.write_text(json.dumps(data))
    assert golden.stored(key, str(tmp_path)) is None
    data[entry["name"]]["torch"] = torch.__version__
    manifest.write_text(json.dumps(data))
    f = tmp_path / entry["file"]
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 0xFF
    f.write_bytes(bytes(raw))
    assert golden.stored(key, str(tmp_path)) is None  # sha256 no longer matches


def test_check_flags_stale_tensors_and_a_torch_upgrade(tmp_path):
    case = tiny_case()
    (entry,) = golden.record([case], str(tmp_path))
    f = tmp_path / entry["file"]
    tensors = load_file(str(f))
    tensors["param/0/blocks.9.ghost"] = torch.zeros(3)  # a tensor the model no longer has
    tensors["param/1/head.out.weight"] = tensors["param/1/head.out.weight"] + 1e-3
    save_file(tensors, str(f))
    manifest = tmp_path / "manifest.json"
    data = json.loads(manifest.read_text())
    data[entry["name"]]["sha256"] = golden.sha256(str(f))
    data[entry["name"]]["torch"] = "2.0.0"
    manifest.write_text(json.dumps(data))
    (row,) = golden.check(str(tmp_path))
    assert row["sha256_ok"] and not row["ok"]
    assert row["stale"] == ["param/0/blocks.9.ghost"]
    assert not row["match"] and row["max_abs"] >= 1e-3 * 0.99
    assert row["torch_changed_numbers"]  # recorded with 2.0.0, numbers differ now
