"""How ``parbench estimate`` shows a configuration: a summary read at a glance (memory per rank
against the device, step time, tokens/s, MFU, the heaviest axis, the bubble), the full
breakdown with ``verbose=true`` (or ``--wide``), everything with ``--json``."""
from __future__ import annotations

import math
from typing import Any

from .training import Training
from .model import StepTime
from .profile import Profile

GB = 1e9


def _gb(x: float) -> str:
    return f"{x / GB:,.1f} GB"


def _s(x: float) -> str:
    if x >= 1:
        return f"{x:,.3g} s"
    if x >= 1e-3:
        return f"{x * 1e3:,.3g} ms"
    return f"{x * 1e6:,.3g} us"


def summary(model: str, shape, trn: Training, st: StepTime | None, profile: Profile | None,
            est: Any) -> list[str]:
    """The lines of the at-a-glance summary (rich markup) of an ``analytic.Estimate``, with
    the time model's step when ``st`` is given."""
    lines = [_headline(model, shape, trn)]
    if st is None or profile is None:
        mem = est.memory
        lines.append(f"  memory per rank  {_gb(mem.per_rank)} (model states "
                     f"{_gb(mem.model_states.selected.total)}, activations "
                     f"{_gb(mem.activations.first_stage_korthikanti)}); add device=a100-80gb "
                     "(or a calibrated profile) for the step time")
        return lines
    return lines + _step_lines(trn, st, profile) + _notes(trn, st)


def _headline(model: str, shape, trn: Training) -> str:
    """Model, parameters, degrees, options, devices, batch and precision."""
    lay, opt = trn.layout, trn.options
    from ..analytic.params import active_params, mtp_params, total_params
    try:
        n, active, mtp = total_params(shape), active_params(shape), mtp_params(shape)
    except Exception:  # noqa: BLE001 - a shape the param count refuses: leave it out
        n = active = mtp = float("nan")
    count = f"{n / 1e9:,.1f} B parameters"
    if getattr(shape, "mtp_layers", 0):  # the main model's count is the one papers publish
        count += f" with {mtp / 1e9:,.1f} B in {shape.mtp_layers} MTP module(s)"
    if getattr(shape, "moe", False):  # an MoE model: what a token passes through too
        count += f", {active / 1e9:,.1f} B active"
    deg = " ".join(f"{k}={v}" for k, v in lay.degrees().items() if v > 1) or "one device"
    extra = [f"vpp={lay.vpp}"] if lay.vpp > 1 else []
    if opt.tensor.sp:
        extra.append("sp")
    if opt.data.zero_stage:
        extra.append(f"ZeRO-{opt.data.zero_stage}")
    if opt.recompute != "none":
        extra.append(f"recompute={opt.recompute}")
    if opt.recompute == "selective" and opt.recompute_modules != "core_attn":
        extra.append(f"recompute_modules={opt.recompute_modules}")
    if lay.pp > 1:
        extra.append(f"schedule={lay.schedule}")
    m = lay.num_microbatches
    return (f"[bold]{model}[/] ({count}): {deg}"
            + (f" ({', '.join(extra)})" if extra else "")
            + f" on {lay.world_size:,} devices; global batch {lay.global_batch_size:,} x "
            f"{shape.s:,} tokens ({m} micro-batch{'es' if m > 1 else ''} of "
            f"{lay.micro_batch_size} per dp rank), {trn.dtype}")


def device_kind(profile: Profile) -> str:
    """How far the profile's figures can be trusted, in words (``estimate`` and ``plan``
    print it beside the device): measured by ``parbench calibrate``, or a preset written
    from datasheets and published micro-benchmarks (``timemodel.devices``), not measured on
    the user's machines."""
    if profile.calibrated:
        return "calibrated profile"
    return "uncalibrated preset: datasheet and published micro-benchmark figures"


def _step_lines(trn: Training, st: StepTime, profile: Profile) -> list[str]:
    """The device, memory against it, the step, where its time goes, the heaviest axis."""
    kind = device_kind(profile)
    md = st.breakdown.get("memory", {})
    verdict = "[green]fits[/]" if st.fits else "[bold red]DOES NOT FIT[/]"
    dev = f"of {_gb(st.device_memory_bytes)}" if st.device_memory_bytes else ""
    lines = [f"device {profile.name} ({kind})",
             f"  memory per rank  {_gb(st.memory_per_rank_bytes)} {dev}  {verdict}  "
             f"(model states {_gb(md.get('model_states', 0))}, activations "
             f"{_gb(md.get('activations', 0) + md.get('logits', 0))}, pipeline rank "
             f"{md.get('stage', 0)})",
             f"  step time        {_s(st.step_s)}   {st.tokens_per_s:,.0f} tokens/s   "
             f"MFU {100 * st.mfu:.1f}%"]
    parts = [f"compute {_s(st.compute_s)}"]
    if st.recompute_s:
        parts.append(f"recompute {_s(st.recompute_s)}")
    if trn.layout.pp > 1:
        parts.append(f"bubble {_s(st.bubble_s)} ({100 * st.bubble_s / st.step_s:.1f}%)")
    for ax, v in sorted(st.exposed_comm_s.items(), key=lambda kv: -kv[1]):
        parts.append(f"{ax} {_s(v)}")
    lines.append("  where it goes    " + " · ".join(parts) + "  (communication: exposed)")
    if st.heaviest_axis:
        v = st.exposed_comm_s[st.heaviest_axis]
        lines.append(f"  heaviest axis    {st.heaviest_axis}: {_s(v)} exposed, "
                     f"{100 * v / st.step_s:.1f}% of the step")
    return lines


def _notes(trn: Training, st: StepTime) -> list[str]:
    """The time model's notes, a starved pipeline, and what MFU counts."""
    lay = trn.layout
    lines = []
    for note in st.notes:
        color = "red" if note.startswith("over memory") else "yellow"
        lines.append(f"  [{color}]note[/]: {note}")
    if lay.pp > 1 and lay.num_microbatches < lay.pp:
        lines.append(f"  [yellow]note[/]: {lay.num_microbatches} micro-batch"
                     f"{'es' if lay.num_microbatches > 1 else ''} on a "
                     f"{lay.pp}-stage pipeline: most of the step is bubble; give "
                     "global_batch_size= or num_microbatches=")
    lines.append("  MFU: model FLOPs of the step without recomputation (3 x forward, "
                 "Korthikanti et al. 2022) / (step x devices x peak)")
    return lines


def breakdown_rows(st: StepTime) -> list[tuple[str, str]]:
    """The time model's terms as (quantity, value) rows for ``verbose``."""
    b = st.breakdown
    rows = [("step", _s(st.step_s)), ("tokens/s", f"{st.tokens_per_s:,.0f}"),
            ("MFU", f"{100 * st.mfu:.2f}%"), ("compute (critical rank)", _s(st.compute_s)),
            ("recompute", _s(st.recompute_s)), ("bubble", _s(st.bubble_s))]
    for ax, v in st.exposed_comm_s.items():
        rows.append((f"exposed communication {ax}", _s(v)))
    rows += [("pipeline makespan", _s(b.get("pipeline_s", 0.0))),
             ("point-to-point per boundary", _s(b.get("p2p_s", 0.0))),
             ("optimizer", _s(b.get("optimizer_s", 0.0))),
             ("loss all-reduce", _s(b.get("loss_allreduce_s", 0.0))),
             ("overlap fraction of the device", f"{b.get('overlap_fraction', 1.0):.2f}")]
    dp = b.get("dp", {})
    for k, v in dp.items():
        rows.append((f"dp {k}", _s(v)))
    pm = b.get("per_microbatch", {})
    layer = pm.get("layer", {})
    for k in ("fwd_s", "bwd_input_s", "bwd_weight_s", "recompute_s"):
        rows.append((f"one layer, one micro-batch: {k[:-2].replace('_', ' ')}",
                     _s(layer.get(k, 0.0))))
    for k in ("comm_fwd_s", "comm_bwd_s"):
        for ax, v in (layer.get(k) or {}).items():
            rows.append((f"one layer, one micro-batch: {ax} {k[5:8]}", _s(v)))
    for name in ("embedding", "head"):
        d = pm.get(name, {})
        rows.append((f"{name}, one micro-batch: fwd / bwd / comm",
                     f"{_s(d.get('fwd_s', 0))} / {_s(d.get('bwd_s', 0))} / "
                     f"{_s(d.get('comm_s', 0))}"))
    stages = pm.get("stages", [])
    if len(stages) > 1:
        for i, s in enumerate(stages[:8]):
            rows.append((f"virtual stage {i}: tf / tb / tw", f"{_s(s['tf_s'])} / "
                         f"{_s(s['tb_s'])} / {_s(s['tw_s'])}"))
        if len(stages) > 8:
            rows.append(("virtual stages", f"{len(stages)} (first 8 shown)"))
    mem = b.get("memory", {})
    for k in ("model_states", "activations", "logits", "activation_per_layer"):
        if k in mem:
            rows.append((f"memory {k.replace('_', ' ')}", _gb(mem[k])))
    if "in_flight_microbatches" in mem:
        rows.append(("micro-batches in flight at the peak", f"{mem['in_flight_microbatches']}"))
    rows.append(("memory accounting", str(mem.get("accounting", ""))))
    rows.append(("model FLOPs per step", f"{b.get('model_flops', 0):.4g}"))
    rows.append(("device peak", f"{b.get('peak_flops', 0) / 1e12:,.1f} TFLOP/s"))
    return rows


def as_json(st: StepTime, trn: Training, profile: Profile) -> dict[str, Any]:
    from dataclasses import asdict
    d = st.as_dict()
    d["layout"] = {k: (v if not (isinstance(v, float) and math.isinf(v)) else "inf")
                   for k, v in asdict(trn).items()}
    d["device"] = profile.summary()
    return d
