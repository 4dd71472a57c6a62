"""The analytic verbs of the command line: ``estimate`` and ``traffic``.

Each turns ``key=value`` arguments into a call of the pure functions in
``parbench.analytic`` and renders the result (rich tables, or JSON
with ``--json``). Nothing here spawns a rank.
"""
from __future__ import annotations

import dataclasses
import json

from rich.table import Table

from ..config import ConfigError
from ..overrides import coerce, number, parse_overrides
from ..report import fmt_bytes
from .output import console as make_console


def _walk(d: dict, prefix: str = ""):
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            yield from _walk(v, key + ".")
        else:
            yield key, v


#: leaf names that are counts, sizes or choices even inside a byte-valued section
_NOT_BYTES = ("params", "group_size", "zero_stage", "stage", "count", "layers", "tokens",
              "rows", "capacity", "top_k", "ep", "etp", "edp", "per_micro_batch",
              "logits_bytes")


def _fmt(key: str, v) -> str:
    leaf = key.rsplit(".", 1)[-1]
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        if any(w in key for w in ("bytes", "memory", "model_states", "activation", "padded",
                                  "baseline", "P_os")) and "gb" not in key.lower() \
                and not any(leaf == w or leaf.endswith(w) for w in _NOT_BYTES) \
                and not leaf.startswith("moe_") and leaf != "bytes_per_element":
            return f"{fmt_bytes(v)}  ({v:,.0f} B)"
        if abs(v) >= 1e6:
            return f"{v:.4g}"
        return f"{v:g}" if isinstance(v, float) else str(v)
    return str(v)


def _render_sections(data: dict, title: str) -> None:
    console = make_console()
    for section, body in data.items():
        t = Table(title=f"{title}: {section}", show_header=False)
        t.add_column("quantity", style="cyan")
        t.add_column("value")
        if isinstance(body, dict):
            for k, v in _walk(body):
                t.add_row(k, _fmt(k, v))
        else:
            t.add_row(section, _fmt(section, body))
        console.print(t)


# ---- estimate -------------------------------------------------------------------------------

#: estimate's own keys: name -> (keyword of analytic.estimate, integer, minimum)
_ESTIMATE_INTS = {"tp": "tp", "pp": "pp", "dp": "dp", "cp": "cp", "ep": "ep", "vpp": "vpp",
                  "micro_batch_size": "micro_batch", "global_batch_size": "global_batch",
                  "num_microbatches": "num_microbatches"}
_MODEL_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "ffn_hidden_size",
                 "seq_length", "num_experts", "moe_top_k", "moe_every", "moe_capacity_factor",
                 "tie_embeddings", "position_embeddings", "num_kv_heads", "mlp", "norm", "bias",
                 "make_vocab_size_divisible_by")
#: MoE fields read into the analytic shape directly while ``ModelConfig`` lacks them:
#: name -> (integer, minimum)
_SHAPE_ONLY = {"moe_every": (True, 1), "moe_capacity_factor": (False, 0)}
_CHOICES = {"recompute": ("none", "selective", "full"),
            "cp_algorithm": ("ring-attention", "ulysses", "allgather"),
            "attention": ("eager", "flash"), "causal_flops": ("full", "half")}
#: logits_dtype= -> bytes per logit (the last stage's cross-entropy input)
_LOGITS_DTYPES = {"fp32": 4, "bf16": 2, "fp16": 2}


def cmd_estimate(args: list[str], as_json: bool = False, wide: bool = False) -> int:
    from .. import analytic
    from ..analytic.memory import ACCOUNTING_ALIASES, ACCOUNTINGS
    from ..config import CaseConfig, ModelConfig, validate_model
    from ..imports import megatron_overrides
    from ..overrides import apply_overrides

    ov = parse_overrides(args)
    # the time model's options (parbench.timemodel): device=PROFILE, schedule=, verbose=
    tm_opts = {k: ov.pop(k) for k in ("device", "schedule", "verbose", "cp_ulysses",
                                      "bucket_mb") if k in ov}
    model_name = ov.get("model", "custom" if "megatron_args" in ov else
                        ("gpt3-175b" if "params" not in ov else None))
    kwargs: dict = {}
    shape = None
    megatron = ov.pop("megatron_args", None)
    if megatron:
        imported = megatron_overrides(megatron)
        for key, value in imported.items():
            sec, name = key.split(".", 1)
            if sec == "parallel" and name in ("tp", "pp", "cp", "ep", "vpp", "micro_batch_size",
                                              "num_microbatches", "sp"):
                ov.setdefault(name, value)
            elif sec == "model":
                ov.setdefault(name, value)
        ov.setdefault("model", "custom")
    if "params" in ov:
        kwargs["params"] = number("params", ov.pop("params"), minimum=0, strict=True)
        if "model" in ov:
            raise ConfigError("give model=PRESET or params=N, not both")
        bad = [k for k in ov if k in _MODEL_FIELDS]
        if bad:
            raise ConfigError(f"{bad[0]}={ov[bad[0]]} has no meaning with params= (give "
                              "model=PRESET instead)")
    else:
        preset = ov.pop("model", "gpt3-175b")
        model_ov = {k: ov.pop(k) for k in list(ov) if k in _MODEL_FIELDS}
        known = {f.name for f in dataclasses.fields(ModelConfig)}
        shape_ov = {k: number(k, model_ov.pop(k), integer=_SHAPE_ONLY[k][0],
                              minimum=_SHAPE_ONLY[k][1])
                    for k in list(model_ov) if k in _SHAPE_ONLY and k not in known}
        case = CaseConfig(model=ModelConfig()) if preset == "custom" else None
        case = apply_overrides(case or CaseConfig(),
                               ({} if preset == "custom" else {"model": preset}) | model_ov)
        validate_model(case.model)
        try:
            shape = analytic.shape_from(case.model, **shape_ov)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    device_gb = ov.pop("device_gb", None)
    for k in list(ov):
        v = ov.pop(k)
        if k in _ESTIMATE_INTS:
            kwargs[_ESTIMATE_INTS[k]] = number(k, v, integer=True, minimum=1)
        elif k == "etp":
            kwargs["etp"] = number(k, v, integer=True, minimum=0)  # 0: etp = tp
        elif k == "zero_stage":
            kwargs[k] = number(k, v, integer=True, minimum=0)
            if kwargs[k] > 3:
                raise ConfigError(f"zero_stage={v} must be 0, 1, 2 or 3")
        elif k == "sp":
            kwargs["sp"] = coerce(v, bool, "sp")
        elif k in _CHOICES:
            if v not in _CHOICES[k]:
                raise ConfigError(f"{k}={v!r} must be one of {', '.join(_CHOICES[k])}")
            kwargs[k] = v
        elif k == "accounting":
            if v not in ACCOUNTINGS and v not in ACCOUNTING_ALIASES:
                raise ConfigError(f"accounting={v!r} must be one of "
                                  f"{', '.join([*ACCOUNTINGS, *ACCOUNTING_ALIASES])}")
            kwargs[k] = v
        elif k == "logits_dtype":
            if v not in _LOGITS_DTYPES:
                raise ConfigError(f"logits_dtype={v!r} must be fp32, bf16 or fp16")
            kwargs["logits_bytes"] = _LOGITS_DTYPES[v]
        elif k == "generate":
            if "params" in kwargs:
                raise ConfigError(f"generate={v} needs a model (give model=PRESET, not "
                                  "params=)")
            kwargs["generate"] = number(k, v, integer=True, minimum=0)
        elif k == "dtype":
            kwargs["bytes_per_element"] = {"fp32": 4, "bf16": 2, "fp16": 2}.get(v)
            if kwargs["bytes_per_element"] is None:
                raise ConfigError(f"dtype={v!r} must be fp32, bf16 or fp16")
        elif k == "bytes_per_element":
            kwargs[k] = number(k, v, integer=True, minimum=1)
        else:
            raise ConfigError(f"unknown key {k!r} for estimate (model=, params=, "
                              f"megatron_args=, {', '.join(_MODEL_FIELDS)}, "
                              f"{', '.join(_ESTIMATE_INTS)}, etp=, zero_stage=, sp=, "
                              "recompute=, cp_algorithm=, accounting=, attention=, "
                              "causal_flops=, logits_dtype=, generate=, dtype=, "
                              "device_gb=, device=, schedule=, verbose=)")
    if device_gb is not None:
        device_gb = number("device_gb", device_gb, minimum=0, strict=True)
    try:
        result = analytic.estimate(shape, **kwargs)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if device_gb is not None:
        dev = device_gb * 1e9
        dp = kwargs.get("dp", 1)
        mp = kwargs.get("tp", 1) * kwargs.get("pp", 1)
        result["largest_model_fits"] = {
            "device_bytes": dev,
            **{name: analytic.largest_model_fits(dev, dp, stage, analytic.MIXED_ADAM, mp)
               for stage, name in enumerate(("baseline", "P_os", "P_os+g", "P_os+g+p"))},
            "note": "parameters whose mixed-precision Adam model states (K = 12) fit, "
                    "activations ignored (ZeRO paper Table 2)"}
    return _estimate_output(result, shape, model_name, kwargs, tm_opts, as_json, wide)


def _estimate_output(result: dict, shape, model_name, kwargs: dict, tm_opts: dict,
                     as_json: bool, wide: bool) -> int:
    """The summary (default), the full breakdown (``verbose=true`` or ``--wide``), or JSON;
    with ``device=`` the time model's step time, MFU and memory against the device."""
    verbose = coerce(tm_opts.get("verbose", "false"), bool, "verbose") or wide
    st = profile = lay = None
    if "device" in tm_opts:
        if shape is None:
            raise ConfigError("device= needs a model (model=PRESET or its fields), not "
                              "params=")
        from ..timemodel import load_profile, predict_step
        from ..timemodel.report import layout_from_estimate
        profile = load_profile(tm_opts["device"])
        extra: dict = {}
        if "schedule" in tm_opts:
            from ..schedules import SCHEDULES
            if tm_opts["schedule"] not in SCHEDULES:
                raise ConfigError(f"schedule={tm_opts['schedule']!r} must be one of "
                                  f"{', '.join(SCHEDULES)}")
            extra["schedule"] = tm_opts["schedule"]
        if "cp_algorithm" in kwargs:
            extra["cp_algorithm"] = kwargs["cp_algorithm"]
        if "cp_ulysses" in tm_opts:
            extra["cp_ulysses"] = number("cp_ulysses", tm_opts["cp_ulysses"], integer=True,
                                         minimum=1)
        if "bucket_mb" in tm_opts:
            extra["bucket_mb"] = number("bucket_mb", tm_opts["bucket_mb"], minimum=0,
                                        strict=True)
        if kwargs.get("accounting"):
            extra["accounting"] = kwargs["accounting"]
        lay = layout_from_estimate(result["inputs"], extra)
        try:
            st = predict_step(shape, lay, profile)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    elif tm_opts.get("schedule"):
        raise ConfigError("schedule= is read by the time model: give device=PROFILE too")
    if as_json:
        if st is not None:
            from ..timemodel.report import as_json as time_json
            result["time"] = time_json(st, lay, profile)
        print(json.dumps(result, indent=2, default=str))
        return 0
    out = make_console()
    if shape is not None:
        from ..timemodel.report import layout_from_estimate, summary
        lay = lay or layout_from_estimate(result["inputs"], {})
        for line in summary(model_name or "model", shape, lay, st, profile, result):
            out.print(line, highlight=False)
    if verbose or shape is None:
        _render_sections(result, "estimate")
        if st is not None:
            from ..timemodel.report import breakdown_rows
            t = Table(title=f"estimate: time model on {profile.name}", show_header=False)
            t.add_column("quantity", style="cyan")
            t.add_column("value")
            for k, v in breakdown_rows(st):
                t.add_row(k, v)
            out.print(t)
    else:
        out.print("  (--verbose: the full breakdown; --json: every figure)",
                  style="dim")
    return 0


# ---- traffic --------------------------------------------------------------------------------


def cmd_traffic(args: list[str], as_json: bool = False, wide: bool = False) -> int:
    from ..analytic import (TRAFFIC_PRESETS, compare_with_published, field_sources,
                           traffic_table)

    ov = parse_overrides(args)
    name = ov.pop("preset", "ubmesh-moe-2t")
    if name not in TRAFFIC_PRESETS:
        raise ConfigError(f"preset={name!r} is not a traffic preset (choose from "
                          f"{', '.join(TRAFFIC_PRESETS)})")
    cfg = TRAFFIC_PRESETS[name]
    if isinstance(cfg, type):
        cfg = cfg()
    if ov:
        import dataclasses
        fields = {f.name: f for f in dataclasses.fields(cfg)}
        changes = {}
        for k, v in ov.items():
            if k not in fields:
                raise ConfigError(f"unknown key {k!r} for preset {name} (fields: "
                                  f"{', '.join(fields)})")
            cur = getattr(cfg, k)
            changes[k] = type(cur)(number(k, v, integer=isinstance(cur, int), minimum=0,
                                          strict=True))
        cfg = dataclasses.replace(cfg, **changes)
    try:
        rows = traffic_table(cfg)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    checks = compare_with_published(rows) if not ov else []
    data = {"preset": name, "rows": [r.as_dict() for r in rows],
            "sources": field_sources(cfg),
            "published_checks": [c.__dict__ for c in checks]}
    if as_json:
        print(json.dumps(data, indent=2, default=str))
        return 0
    console = make_console()
    t = Table(title=f"Traffic per parallelism, one iteration of {name} (MB = 2^20 B, "
                    "GB = 2^30 B, wire bytes per rank)")
    for col in ("parallelism", "pattern", "per transfer (MB)", "transfers", "total (GB)",
                "share"):
        t.add_column(col)
    for r in data["rows"]:
        t.add_row(r["parallelism"], r["pattern"],
                  "/".join(f"{x:g}" for x in r["per_transfer_MiB"]),
                  "/".join(str(c) for c in r["transfers"]), f"{r['total_GiB']:.6g}",
                  f"{r['share_percent']:.3f}%")
    console.print(t)
    if checks:
        bad = [c for c in checks if not c.ok]
        console.print(f"Against UB-Mesh (arXiv 2503.20377) Table 1: "
                      f"{len(checks) - len(bad)} of {len(checks)} printed cells reproduced.")
        for c in bad:
            console.print(f"  [yellow]printing error[/] {c.parallelism} {c.column}: printed "
                          f"{c.printed}, computed {c.computed}. {c.note}")
    src = Table(title="Where the preset's figures come from")
    src.add_column("field")
    src.add_column("source")
    for k, v in data["sources"].items():
        src.add_row(k, v)
    console.print(src)
    return 0
