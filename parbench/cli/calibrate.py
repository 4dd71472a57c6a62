"""``parbench calibrate [device=cpu|cuda] [key=value ...]``: measure this machine (or, under
torchrun, a cluster node's ranks) and write a device profile for the time model.

Options:

- ``device=cpu|cuda`` (default cpu: gloo, one thread per rank; cuda: NCCL, one GPU per rank);
- ``world_size=N`` local ranks (default 2 on CPU, the GPUs on CUDA; under torchrun the
  job's); ``world_size=1`` measures compute only (one GPU: NCCL refuses two ranks on one
  device), no collectives, and ``links_from=PRESET`` (e.g. ``h200-141gb``) then gives the
  profile that preset's links and collectives, saying so in its ``meta``;
- ``model=PRESET[,PRESET...]`` whose GEMM and attention shapes to time (default ``tiny``,
  the suites' model; ``model=none``: generic sizes only; ``model=FILE.json``: a JSON
  object of model fields, a model no preset holds), at ``micro_batch_sizes=1,2,4``,
  ``tp=1,2`` and ``cp=1,2`` (comma lists);
- ``dtypes=fp32[,bf16]``; ``quick=true`` (fewer repeats and sizes, for a smoke test; on
  CUDA it keeps a 1 GiB copy and square GEMMs up to 8192, sizes that fill a GPU);
- ``name=cpu-local`` (the name ``device=`` finds it by) and ``out=FILE.json`` (also write
  there); the profile is saved in ``$PARBENCH_PROFILE_DIR`` (default
  ``~/.cache/parbench/profiles``);
- ``instrumented=true``: time collectives inside parbench's recording ledger and timeline, as
  the harness's timed steps run them with ``instrument=true`` (default false: the machine
  itself);
- ``reference=false``: skip timing the reference model's single-rank step (a check of the
  compute model printed at the end, not an input).
"""
from __future__ import annotations

import json

from ..config import ConfigError
from ..overrides import coerce, parse_overrides
from .output import console


def _ints(key: str, value: str) -> tuple[int, ...]:
    out = tuple(coerce(x, int, key) for x in str(value).split(",") if x.strip())
    if not out or any(x < 1 for x in out):
        raise ConfigError(f"{key}={value!r} must be a comma list of positive integers")
    return out


_KEYS = ("device=, world_size=, model=, micro_batch_sizes=, tp=, cp=, dtypes=, quick=, "
         "instrumented=, reference=, name=, out=, links_from=")


def _models(ov: dict) -> list[str]:
    from ..config import PRESETS
    models = [m for m in str(ov.pop("model", "tiny")).split(",") if m and m != "none"]
    for m in models:
        if m not in PRESETS and not m.endswith(".json"):
            raise ConfigError(f"model={m!r} is not a preset (choose from {', '.join(PRESETS)}) "
                              "nor a .json file of model fields")
    return models


def _plans(ov: dict, device: str, models: list[str]):
    """The plan of the first model (None: generic sizes only) and one plan per further
    model (their GEMM and attention shapes), from the verb's keys."""
    from ..analytic.shape import shape_from
    from ..calibration import Plan
    from ..calibration.plan import model_config
    mbs = _ints("micro_batch_sizes", ov.pop("micro_batch_sizes", "1,2,4"))
    tps = _ints("tp", ov.pop("tp", "1,2"))
    cps = _ints("cp", ov.pop("cp", "1,2"))
    dtypes = tuple(ov.pop("dtypes", "fp32").split(","))
    for d in dtypes:
        if d not in ("fp32", "bf16", "fp16"):
            raise ConfigError(f"dtypes={d!r} must be fp32, bf16 or fp16")
    quick = coerce(ov.pop("quick", "false"), bool, "quick")
    instrumented = coerce(ov.pop("instrumented", "false"), bool, "instrumented")
    shapes = [shape_from(model_config(m)) for m in models]
    plan = Plan(device=device, dtypes=dtypes, shape=shapes[0] if shapes else None,
                micro_batch_sizes=mbs, tp_splits=tps, cp_splits=cps,
                instrumented=instrumented)
    if quick:
        plan.message_bytes = (4, 4096, 262144, 1 << 20)
        plan.square_sizes = (128, 256)
        plan.copy_bytes = 16 << 20
        if device == "cuda":  # a GPU's figures need sizes that fill it
            plan.square_sizes, plan.copy_bytes = (1024, 4096, 8192), 1 << 30
        plan.repeats = 3
        plan.min_time_s = 0.01
    extra = [Plan(device=device, dtypes=dtypes, shape=s, micro_batch_sizes=mbs,
                  tp_splits=tps, cp_splits=cps) for s in shapes[1:]]
    return plan, extra


def _device_and_world(ov: dict) -> tuple[str, int]:
    """``device=`` and ``world_size=`` (default 2 on CPU, the GPUs on CUDA), checked before
    any rank is spawned: CUDA must be here, and NCCL needs one GPU per rank."""
    from ..device import DeviceError, require
    device = ov.pop("device", "cpu")
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"device={device!r} must be cpu or cuda")
    try:
        require(device)
        default = "2"
        if device == "cuda":
            import torch
            default = str(max(1, torch.cuda.device_count()))
        world = coerce(ov.pop("world_size", default), int, "world_size")
        if world < 1:
            raise ConfigError(f"world_size={world} must be >= 1 (1: compute only, no "
                              "collectives)")
        require(device, world)
    except DeviceError as e:
        raise ConfigError(str(e)) from None
    return device, world


def _links_from(name: str | None):
    """``links_from=PRESET``: the datasheet preset whose links and collectives a one-rank
    profile takes (None: none)."""
    if name is None:
        return None
    from ..timemodel import PRESETS, load_profile
    if name not in PRESETS:
        raise ConfigError(f"links_from={name!r} must be a device preset "
                          f"({', '.join(PRESETS)})")
    return load_profile(name)


def cmd_calibrate(args: list[str], as_json: bool = False, wide: bool = False) -> int:
    from ..calibration import add_model_shapes, calibrate, reference_check, with_links_of
    from ..timemodel.profile import profile_dir

    ov = parse_overrides(args)
    device, world = _device_and_world(ov)
    models = _models(ov)
    plan, extra_plans = _plans(ov, device, models)
    reference = coerce(ov.pop("reference", "true"), bool, "reference")
    name, out = ov.pop("name", None), ov.pop("out", None)
    links = _links_from(ov.pop("links_from", None))
    if ov:
        raise ConfigError(f"unknown key {sorted(ov)[0]!r} for calibrate ({_KEYS})")
    say = console(stderr=True).print
    mbs = plan.micro_batch_sizes
    ref = (models[0], mbs[min(1, len(mbs) - 1)], 2) if (reference and models) else None
    profile = calibrate(plan, world, name, reference=ref, progress=lambda s: say(f"  {s}"))
    if extra_plans:
        add_model_shapes(profile, extra_plans, world, plan)
    if links is not None:
        with_links_of(profile, links)
    path = profile.save(profile_dir() / f"{profile.name}.json")
    if out:
        profile.save(out)
    check = reference_check(profile)
    if as_json:
        print(json.dumps({"profile": profile.to_dict(), "saved": str(path),
                          "reference_check": check}, indent=2, default=str))
        return 0
    render(profile, str(path), check)
    return 0


def render(profile, path: str, check: dict | None) -> None:
    from rich.table import Table
    out = console()
    out.print(f"[bold]{profile.name}[/]: {profile.description}")
    t = Table(title="compute (slowest rank's medians, all ranks at once)", show_header=False)
    t.add_column("quantity", style="cyan")
    t.add_column("value")
    for dt, v in profile.matmul_flops.items():
        t.add_row(f"matmul peak {dt}", f"{v / 1e9:.2f} GFLOP/s (best of "
                  f"{sum(1 for g in profile.gemms if g['dtype'] == dt)} GEMMs)")
    t.add_row("memory bandwidth", f"{profile.mem_bandwidth / 1e9:.2f} GB/s (copy, read + write)")
    t.add_row("eager operator", f"{profile.op_overhead_s * 1e6:.2f} us")
    t.add_row("autograd node", f"{profile.bwd_op_overhead_s * 1e6:.2f} us")
    t.add_row("backward() call", f"{profile.backward_call_s * 1e6:.2f} us")
    t.add_row("AdamW", f"{profile.optimizer.get('per_tensor_s', 0) * 1e6:.2f} us per tensor + "
              f"{profile.optimizer.get('per_element_s', 0) * 1e9:.3f} ns per element")
    t.add_row("overlap", f"{profile.overlap:.2f} of an all-reduce hidden under GEMMs")
    t.add_row("blocking send", "yes: a send returns once its receive is posted"
              if profile.p2p_blocking else "no")
    out.print(t)
    c = Table(title="collectives: t = alpha + S / bandwidth (S: message bytes)")
    for col in ("link", "op", "ranks", "alpha (us)", "bandwidth (GB/s)", "points",
                "max error"):
        c.add_column(col)
    for lk, ops in profile.collectives.items():
        for op, fits in ops.items():
            for n, f in sorted(fits.items()):
                c.add_row(lk, op, str(n), f"{f.alpha_s * 1e6:.1f}", f"{f.bandwidth / 1e9:.3f}",
                          str(f.points), f"{100 * f.max_rel_err:.0f}%")
    out.print(c)
    if check:
        out.print(f"compute model check: the {check['model']} reference step on one rank "
                  f"({check['num_microbatches']} micro-batches of {check['micro_batch_size']}) "
                  f"measured {check['measured_s'] * 1e3:.2f} ms, predicted "
                  f"{check['predicted_s'] * 1e3:.2f} ms ({100 * check['error']:+.1f}%)")
    load = profile.meta.get("load_average")
    if load:
        out.print(f"load average during calibration: {load[0]:.2f} on "
                  f"{profile.meta.get('cpus')} cores")
    out.print(f"saved: {path}  (use it as device={profile.name})")
