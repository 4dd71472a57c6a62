"""Golden files (issue 20, section 6): the key, serving by prefix, record, and the check's
noise rule -- green under reduction-order noise, red when the reference numbers change."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from parbench import golden
from parbench.config import CaseConfig, ModelConfig, RunConfig
from parbench.golden import key as golden_keys
from parbench.golden import store
from parbench.golden.run import reference_model
from parbench.model import make_optimizer
from parbench.model.moe import RoutingGroups
from parbench.overrides import apply_overrides
from parbench.verdict import compare


def tiny_case(**extra):
    return apply_overrides(CaseConfig(), {"model": "tiny", "dp": "2", "steps": "3", **extra})


def recorded(tmp_path, case, steps=3):
    """Record ``case``'s golden run in ``tmp_path``; its manifest entry."""
    (entry,) = golden.record([golden.Wanted(golden.golden_key(case), case, None, steps,
                                            ["test/case"])], str(tmp_path))
    return entry


# ---- the key --------------------------------------------------------------------------------

@pytest.mark.parametrize("harmless", [
    {"dp": "1", "micro_batch_size": "4"}, {"num_microbatches": "2", "micro_batch_size": "1"},
    {"tp": "2"}, {"sp": "true", "tp": "2"}, {"zero_stage": "3"}, {"scheme": "zero.3"},
    {"rtol": "1e-4"}, {"param_atol": "1e-3"}, {"timed_steps": "7"}, {"steps": "5"},
    {"recompute": "full"}, {"bucket_mb": "4"}])
def test_the_key_ignores_what_the_golden_run_does_not_read(harmless):
    assert golden.golden_key(tiny_case(**harmless)) == golden.golden_key(tiny_case())


def _another(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    return {"fp32": "bf16", "adamw": "sgd"}.get(value, value + "x")


def test_every_run_and_model_field_the_golden_may_read_is_in_the_key():
    """Deny-listed fields stay out; every other field -- including one added later -- is in
    as soon as it leaves its default, so no two different references share a key."""
    base = tiny_case()
    run_names = {f.name for f in dataclasses.fields(RunConfig)}
    assert golden_keys.RUN_FIELDS_NOT_READ <= run_names  # no stale names in the deny list
    for f in dataclasses.fields(RunConfig):
        if f.name in golden_keys.RUN_FIELDS_NOT_READ:
            continue
        changed = dataclasses.replace(base, run=dataclasses.replace(
            base.run, **{f.name: _another(getattr(base.run, f.name))}))
        assert golden.golden_key(changed) != golden.golden_key(base), f.name
    for f in dataclasses.fields(ModelConfig):
        if f.name == "name":
            continue
        changed = dataclasses.replace(base, model=dataclasses.replace(
            base.model, **{f.name: _another(getattr(base.model, f.name))}))
        assert golden.golden_key(changed) != golden.golden_key(base), f.name


def test_the_key_follows_batch_seed_and_routing_groups():
    moe = tiny_case(num_experts="4", ep="2")
    keys = {golden.golden_key(tiny_case()), golden.golden_key(tiny_case(dp="4")),
            golden.golden_key(tiny_case(seed="7")),
            golden.golden_key(moe, RoutingGroups(rows=2)),
            golden.golden_key(moe, RoutingGroups(rows=1))}
    assert len(keys) == 5
    # a dense model's key ignores routing groups
    assert golden.golden_key(tiny_case(), RoutingGroups(1)) == golden.golden_key(tiny_case())


def test_a_case_rebuilt_from_its_key_has_that_key_and_that_run():
    moe = tiny_case(num_experts="4", ep="2", lr="3e-3", hidden_size="48")
    routing = RoutingGroups(rows=2)
    key = golden.golden_key(moe, routing)
    case, back = golden.case_of_key(key)
    assert back == routing and golden.golden_key(case, back) == key
    assert golden.train(case, 1, back).losses == golden.train(moe, 1, routing).losses
    with pytest.raises(ValueError, match="another format"):
        golden.case_of_key(json.dumps([{"model": {}}, 8]))


# ---- served, by prefix ---------------------------------------------------------------------

def _equal(a, b) -> bool:
    return (a.losses == b.losses and len(a.params) == len(b.params)
            and all(torch.equal(x[n], y[n]) for xs, ys in ((a.grads, b.grads),
                                                          (a.params, b.params))
                    for x, y in zip(xs, ys) for n in x))


def test_a_stored_run_serves_shorter_and_longer_requests_exactly(tmp_path, monkeypatch):
    case = tiny_case()
    entry = recorded(tmp_path, case, steps=3)
    monkeypatch.setattr(store, "GOLDEN_DIR", str(tmp_path))
    monkeypatch.setattr(store, "_CACHE", {})
    for steps, source in ((2, f"stored:{entry['file']}"), (3, f"stored:{entry['file']}"),
                          (5, f"stored:{entry['file']}+live")):
        served = golden.reference_run(case, steps)
        assert served.source == source
        assert _equal(served, golden.train(case, steps))  # same numbers, bit for bit
    assert golden.reference_run(tiny_case(seed="7"), 2).source == "live"


def test_a_tampered_foreign_or_old_golden_file_is_not_served(tmp_path):
    case = tiny_case()
    entry = recorded(tmp_path, case)
    key, manifest = golden.golden_key(case), tmp_path / "manifest.json"
    data = json.loads(manifest.read_text())
    run = data["runs"][entry["name"]]
    run["torch"] = golden.torch_release() + "+cu128"  # another build of this release: served
    manifest.write_text(json.dumps(data))
    assert golden.stored(key, str(tmp_path)) is not None
    run["torch"] = "0.0.0"  # another release
    manifest.write_text(json.dumps(data))
    assert golden.stored(key, str(tmp_path)) is None
    run["torch"] = torch.__version__
    manifest.write_text(json.dumps({**data, "format": 1}))  # a manifest of another format
    assert golden.stored(key, str(tmp_path)) is None
    manifest.write_text(json.dumps(data))
    f = tmp_path / entry["file"]
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 0xFF
    f.write_bytes(bytes(raw))
    assert golden.stored(key, str(tmp_path)) is None  # sha256 no longer matches


def test_record_keeps_exactly_what_it_recorded(tmp_path):
    first = recorded(tmp_path, tiny_case(seed="7"))
    second = recorded(tmp_path, tiny_case())
    assert not (tmp_path / first["file"]).exists() and (tmp_path / second["file"]).exists()
    runs = json.loads((tmp_path / "manifest.json").read_text())["runs"]
    assert list(runs) == [second["name"]] and runs[second["name"]]["cases"] == ["test/case"]
    assert "parbench golden record" in json.loads((tmp_path / "manifest.json").read_text())[
        "record"]


# ---- the check: the verdict's noise rule ---------------------------------------------------

def _split_batch_run(case, steps):
    """The golden run with each step's batch in two halves, gradients accumulated: the same
    arithmetic in another summation order, as another CPU or torch build would sum it."""
    model = reference_model(case)
    opt = make_optimizer(model.parameters(), case.run)
    out = golden.GoldenRun()
    for step in range(steps):
        x, y = golden.global_batch(case, step)
        opt.zero_grad(set_to_none=True)
        h, loss = x.shape[0] // 2, 0.0
        for part in (slice(0, h), slice(h, None)):
            half = model(x[part], y[part]) / 2
            half.backward()
            loss += float(half.detach())
        out.losses.append(loss)
        out.grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        opt.step()
        out.params.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return out


def _overwrite(tmp_path, entry, tensors):
    f = tmp_path / entry["file"]
    save_file(tensors, str(f))
    manifest = tmp_path / "manifest.json"
    data = json.loads(manifest.read_text())
    data["runs"][entry["name"]]["sha256"] = golden.sha256(str(f))
    manifest.write_text(json.dumps(data))


def test_check_passes_reduction_order_noise_that_a_flat_atol_rejects(tmp_path):
    case = tiny_case()
    entry = recorded(tmp_path, case)
    other = _split_batch_run(case, 3)
    _overwrite(tmp_path, entry, golden.to_tensors(other))
    live = golden.train(case, 3)
    # the noise is real, and a flat atol 1e-6 on parameters (the old check) calls it a failure
    assert not compare(other.params[2], live.params[2], 0.0, 1e-6)["ok"]
    (row,) = golden.check(str(tmp_path))
    assert row["ok"] and not row["bitwise"], row
    assert row["quantities"]["step-0 gradients"]["max_abs"] > 0


@pytest.mark.parametrize("change, failing", [
    ("layernorm-eps", "step-0 gradients"),  # the model's numbers change
    ("adamw-eps", "later gradients"),  # the optimizer's numbers change
])
def test_check_catches_a_change_of_the_reference_numbers(tmp_path, monkeypatch, change,
                                                         failing):
    """What a torch upgrade that changes a kernel's or a default's semantics looks like."""
    case = tiny_case()
    recorded(tmp_path, case)
    if change == "layernorm-eps":
        ln = F.layer_norm
        monkeypatch.setattr(F, "layer_norm", lambda x, shape, w=None, b=None, eps=1e-5:
                            ln(x, shape, w, b, 1e-3))
    else:
        import parbench.golden.run as run_module

        def adamw_eps_1e6(params, run):
            return torch.optim.AdamW(list(params), lr=run.lr, betas=(run.beta1, run.beta2),
                                     eps=1e-6, weight_decay=run.weight_decay, foreach=False)
        monkeypatch.setattr(run_module, "make_optimizer", adamw_eps_1e6)
    (row,) = golden.check(str(tmp_path))
    assert not row["ok"] and row["sha256_ok"]
    assert not row["quantities"][failing]["ok"], row["quantities"]


def test_check_flags_stale_and_missing_tensors_and_a_missing_file(tmp_path):
    case = tiny_case()
    entry = recorded(tmp_path, case)
    tensors = load_file(str(tmp_path / entry["file"]))
    tensors["grad/0/blocks.9.ghost"] = torch.zeros(3)  # a parameter the model no longer has
    del tensors["grad/1/head.out.weight"]
    _overwrite(tmp_path, entry, tensors)
    (row,) = golden.check(str(tmp_path))
    assert row["sha256_ok"] and not row["ok"]
    assert row["stale"] == ["grad/0/blocks.9.ghost"] and row["new"] == ["grad/1/head.out.weight"]
    (tmp_path / entry["file"]).unlink()
    (row,) = golden.check(str(tmp_path))
    assert not row["exists"] and not row["ok"]


def test_the_golden_run_clips_by_global_norm_and_reports_the_clipped_gradients():
    """clip_grad: every step's gradients (what the optimizer steps on) have global norm
    min(norm, clip), and the unclipped run's gradients are the same direction."""
    import math

    from parbench.config import CaseConfig
    from parbench.golden.run import train
    from parbench.model.training import clip_coefficient
    from parbench.overrides import apply_overrides
    case = apply_overrides(CaseConfig(), {"model": "tiny", "clip_grad": "0.5"})
    free = apply_overrides(CaseConfig(), {"model": "tiny"})
    clipped, unclipped = train(case, 1), train(free, 1)
    norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in unclipped.grads[0].values()))
    got = math.sqrt(sum(float(g.double().pow(2).sum()) for g in clipped.grads[0].values()))
    assert norm > 0.5 and abs(got - 0.5) < 1e-5
    coef = clip_coefficient(norm, 0.5)
    for n, g in unclipped.grads[0].items():
        assert (clipped.grads[0][n] - coef * g).abs().max() <= 1e-6 * (1 + g.abs().max())
    assert clip_coefficient(0.3, 0.5) == 1.0 and clip_coefficient(3.0, 0.0) == 1.0
