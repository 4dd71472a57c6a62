"""The device check's Python side (``scripts/device_check.sh``): what it runs and how it sums
up. ``python -m parbench.devicecheck VERB key=value ...``:

- ``preflight device=cpu|cuda out=DIR``: the device is here (else one line, exit 2), the
  paths chosen on it (multi-rank backend, the profile's file) printed and written to
  ``DIR/device.json``;
- ``keys device=``: the step model's ``key=value`` words (for ``parbench estimate``);
  ``model-json device= out=FILE``: its model fields (for ``parbench calibrate model=``);
- ``step device= out=DIR``: the ~1B-parameter single-GPU step (on CPU a small model),
  measured with the harness's own instruments (``parbench.harness.time_case``: the scheme's
  ``train_step``, CUDA events, the allocator's peak) on one rank; ``DIR/step.json``;
- ``summary device= out=DIR``: every step's status, the cases' rows, the profile, the
  predicted (``parbench estimate`` with the calibrated profile and with the datasheet
  preset) against the measured step and MFU; ``DIR/summary.json`` and ``DIR/summary.md``;
  exit 1 when a required step failed.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from .device import DeviceError, describe, flash_attention, gpu_slug, require

#: the step model per device: on a GPU ~1.02B parameters (GPT-2 style, h 2048, 16 layers,
#: 16 heads of 128, 2048 tokens, a 50,304-token vocabulary, untied: 16 x 50.4M + 2 x 103M +
#: 4M positions), bf16 with fp32 master weights and AdamW (ZeRO-1 at dp=1: parbench's
#: mixed-precision data-parallel scheme; data.ddp trains fp32 only), 25 MiB buckets
#: (Megatron's size: the default 0.25 MiB would make thousands of units); on CPU a small fp32
#: model, so that CI stays fast. ``name`` and ``tie_embeddings`` pin what ``parbench
#: estimate``'s default preset would otherwise give.
STEP_MODELS = {
    "cuda": {"name": "gpt-1b", "tie_embeddings": "false", "hidden_size": 2048,
             "num_layers": 16, "num_heads": 16, "seq_length": 2048, "vocab_size": 50304,
             "micro_batch_size": 2, "num_microbatches": 1, "dtype": "bf16", "zero_stage": 1,
             "bucket_mb": 25},
    "cpu": {"name": "gpt-small", "tie_embeddings": "false", "hidden_size": 64,
            "num_layers": 2, "num_heads": 4, "seq_length": 64, "vocab_size": 256,
            "micro_batch_size": 2, "num_microbatches": 1, "dtype": "fp32", "zero_stage": 1,
            "bucket_mb": 25},
}
#: the harness's steps for the measured step: peak on step 1, the first timed step discarded
STEP_RUN = {"scheme": "zero.1", "steps": 2, "timed_steps": 6, "warmup_steps": 1}
#: what the summary reads: (step name, required) -- a probe's failure is reported, not fatal
STEPS = (("preflight", True), ("single", True), ("multi", False), ("calibrate", True),
         ("step", True), ("estimate-calibrated", True), ("estimate-preset", False))


def parse(argv: list[str]) -> dict[str, str]:
    out = {}
    for a in argv:
        key, eq, value = a.partition("=")
        if not eq:
            raise DeviceError(f"argument {a!r} must be key=value (device=, out=)")
        out[key] = value
    return out


def multi_rank_path(device: str, gpus: int) -> dict:
    """How the device check runs cases of two ranks: on CPU two gloo ranks; on two or more
    GPUs NCCL, one GPU per rank; on one GPU two ranks sharing it over gloo with CUDA tensors
    (NCCL refuses two ranks on one device), a probe with data.ddp (all-reduce: gloo moves
    CUDA tensors for it)."""
    if device == "cpu":
        return {"backend": "gloo", "suite": "multi", "required": True,
                "why": "two gloo ranks on the CPU"}
    if gpus >= 2:
        return {"backend": "nccl", "suite": "multi", "required": True,
                "why": f"NCCL, one GPU per rank ({gpus} GPUs)"}
    return {"backend": "gloo", "suite": "multi-gloo", "required": False,
            "why": "one GPU: NCCL refuses two ranks on one device, so two ranks share "
                   "cuda:0 over gloo with CUDA tensors (PARBENCH_BACKEND=gloo), data.ddp "
                   "only (all-reduce); a probe, not required"}


def preflight(device: str, out: Path) -> dict:
    """The device is here, and the paths the check takes on it."""
    require(device)
    info = describe(device)
    gpus = info.get("count", 0)
    info["multi_rank"] = multi_rank_path(device, gpus)
    if device == "cuda":
        slug = gpu_slug(info["name"], info["memory_bytes"])
        info["profile_path"] = f"results/devices/{slug}.json"
        from .timemodel import PRESETS
        info["preset"] = slug if slug in PRESETS else None
    else:
        info["profile_path"] = str(out / "profile" / "cpu-device-check.json")
        info["preset"] = None
    info["flash_attention"] = flash_report(device)
    out.mkdir(parents=True, exist_ok=True)
    (out / "device.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def model_fields(device: str) -> dict:
    """The step model's ``ModelConfig`` fields (its layout and precision left out)."""
    from .config import ModelConfig
    names = set(ModelConfig.__dataclass_fields__) - {"name"}
    out = {k: v for k, v in STEP_MODELS[device].items() if k in names}
    return {k: v == "true" if v in ("true", "false") else v for k, v in out.items()}


def flash_report(device: str) -> dict:
    """Whether SDPA's flash kernel takes the reference model's attention at the step model's
    head shape: bf16 and fp32 unpacked (``is_causal=True``, no mask) and bf16 packed (a
    mask). On CUDA flash needs fp16 / bf16 and no explicit mask; elsewhere SDPA picks the
    memory-efficient or the math kernel."""
    import torch
    m = STEP_MODELS[device]
    shape = (m["num_heads"], min(m["seq_length"], 1024), m["hidden_size"] // m["num_heads"])
    out = {}
    for label, dtype, masked in (("bf16", torch.bfloat16, False),
                                 ("fp32", torch.float32, False),
                                 ("bf16 packed", torch.bfloat16, True)):
        ok, why = flash_attention(device, dtype, *shape, masked=masked)
        out[label] = "flash" if ok else f"not flash: {why}"
    return out


def step_case(device: str) -> dict:
    """The measured step's case (a ``CaseConfig`` dict) on ``device``."""
    from .suites import expand
    keys = {k: str(v) for k, v in {**STEP_MODELS[device], **STEP_RUN}.items()}
    keys["device"] = device
    return expand({}, keys, default_name="device-check-step").cases[0].to_dict()


def measure_step(device: str) -> dict:
    """The step on one rank (a local pool of one): the harness's ``time_case``."""
    from .harness import time_case
    from .launch import WorkerPool
    case = step_case(device)
    with WorkerPool(1, device=device, timeout_s=600.0, hang_timeout_s=600.0) as pool:
        res = pool.run(time_case, case, timeout_s=900.0, hang_timeout_s=600.0)[0]
    times = sorted(res["step_times"])
    res["median_s"] = times[len(times) // 2] if times else None
    res["model"] = STEP_MODELS[device]
    res["run"] = STEP_RUN
    return res


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        sys.stderr.write("usage: python -m parbench.devicecheck "
                         "preflight|keys|model-json|step|summary device=cpu|cuda out=DIR\n")
        return 2
    verb, rest = argv[0], argv[1:]
    try:
        kv = parse(rest)
        device = kv.get("device", "cuda")
        if device not in ("cpu", "cuda"):
            raise DeviceError(f"device={device!r} must be cpu or cuda")
        out = Path(kv.get("out", "."))
        if verb == "preflight":
            info = preflight(device, out)
            print(f"device: {info['name']} ({info['kind']}); multi-rank: "
                  f"{info['multi_rank']['why']}; profile: {info['profile_path']}")
            return 0
        if verb == "keys":
            print(" ".join(f"{k}={v}" for k, v in STEP_MODELS[device].items()))
            return 0
        if verb == "model-json":  # the step model's fields, for calibrate model=FILE.json
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(model_fields(device), indent=2) + "\n")
            return 0
        if verb == "step":
            require(device)
            res = measure_step(device)
            out.mkdir(parents=True, exist_ok=True)
            (out / "step.json").write_text(json.dumps(res, indent=2, default=str) + "\n")
            print(f"step: median {res['median_s'] * 1e3:.2f} ms over "
                  f"{len(res['step_times'])} timed steps, peak {res['peak_bytes'] / 2**30:.3f} "
                  f"GiB")
            return 0
        if verb == "summary":
            from .devicecheck_summary import summarize
            return summarize(device, out, STEPS, STEP_MODELS[device])
    except DeviceError as e:
        sys.stderr.write(f"device_check: error: {e}\n")
        return 2
    sys.stderr.write(f"device_check: error: unknown verb {verb!r} "
                     "(preflight, keys, model-json, step, summary)\n")
    return 2


if __name__ == "__main__":
    sys.exit(main())
