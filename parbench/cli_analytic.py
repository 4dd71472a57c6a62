"""The analytic verbs of the command line: ``estimate``, ``traffic`` and ``schedule``.

Each turns ``key=value`` arguments into a call of the pure functions in
``parbench.analytic`` / ``parbench.schedules`` and renders the result (rich tables, or JSON
with ``--json``). Nothing here spawns a rank.
"""
from __future__ import annotations

import json

from rich.console import Console
from rich.table import Table

from .config import ConfigError, parse_overrides
from .report import fmt_bytes

_INT_KEYS = ("tp", "pp", "dp", "cp", "ep", "vpp", "zero_stage", "micro_batch_size",
             "global_batch_size", "num_microbatches", "bytes_per_element")


def _num(key: str, value: str, integer: bool = False):
    try:
        f = float(value)
    except ValueError:
        raise ConfigError(f"{key}={value!r} is not a number") from None
    if integer:
        if f != int(f):
            raise ConfigError(f"{key}={value!r} is not an integer")
        return int(f)
    return f


def _walk(d: dict, prefix: str = ""):
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            yield from _walk(v, key + ".")
        else:
            yield key, v


def _fmt(key: str, v) -> str:
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        if any(w in key for w in ("bytes", "memory", "model_states", "activation", "padded",
                                  "baseline", "P_os")) and "gb" not in key.lower():
            return f"{fmt_bytes(v)}  ({v:,.0f} B)"
        if abs(v) >= 1e6:
            return f"{v:.4g}"
        return f"{v:g}" if isinstance(v, float) else str(v)
    return str(v)


def _render_sections(data: dict, title: str) -> None:
    console = Console(width=160)
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


def estimate_command(args: list[str], as_json: bool) -> int:
    from . import analytic
    from .config import model_preset

    ov = parse_overrides(args)
    kwargs: dict = {}
    shape = None
    if "params" in ov:
        kwargs["params"] = _num("params", ov.pop("params"))
        if "model" in ov:
            raise ConfigError("give model=PRESET or params=N, not both")
    else:
        model = model_preset(ov.pop("model", "gpt3-175b"))
        for k in list(ov):
            if hasattr(model, k) and k not in ("name",):
                setattr(model, k, _num(k, ov.pop(k), integer=True))
        if "hidden_size" in args and model.ffn_hidden_size:
            pass
        shape = analytic.shape_from(model)
    device_gb = ov.pop("device_gb", None)
    rename = {"micro_batch_size": "micro_batch", "global_batch_size": "global_batch"}
    for k in list(ov):
        v = ov.pop(k)
        if k in _INT_KEYS:
            kwargs[rename.get(k, k)] = _num(k, v, integer=True)
        elif k == "sp":
            kwargs["sp"] = v.lower() in ("1", "true", "yes")
        elif k in ("recompute", "accounting", "cp_algorithm"):
            kwargs[k] = v
        elif k == "dtype":
            kwargs["bytes_per_element"] = {"fp32": 4, "bf16": 2, "fp16": 2}.get(v)
            if kwargs["bytes_per_element"] is None:
                raise ConfigError(f"dtype={v!r} must be fp32, bf16 or fp16")
        else:
            raise ConfigError(f"unknown key {k!r} for estimate (model=, params=, tp=, pp=, dp=, "
                              "cp=, ep=, vpp=, zero_stage=, micro_batch_size=, "
                              "global_batch_size=, sp=, recompute=, dtype=, device_gb=)")
    try:
        result = analytic.estimate(shape, **kwargs)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if device_gb is not None:
        dev = _num("device_gb", device_gb) * 1e9
        dp = kwargs.get("dp", 1)
        mp = kwargs.get("tp", 1) * kwargs.get("pp", 1)
        result["largest_model_fits"] = {
            "device_bytes": dev,
            **{name: analytic.largest_model_fits(dev, dp, stage, analytic.MIXED_ADAM, mp)
               for stage, name in enumerate(("baseline", "P_os", "P_os+g", "P_os+g+p"))},
            "note": "parameters whose mixed-precision Adam model states (K = 12) fit, "
                    "activations ignored (ZeRO paper Table 2)"}
    if as_json:
        print(json.dumps(result, indent=2, default=str))
    else:
        _render_sections(result, "estimate")
    return 0


# ---- traffic --------------------------------------------------------------------------------


def traffic_command(args: list[str], as_json: bool) -> int:
    from .analytic import (TRAFFIC_PRESETS, compare_with_published, field_sources,
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
            changes[k] = type(cur)(_num(k, v, integer=isinstance(cur, int)))
        cfg = dataclasses.replace(cfg, **changes)
    rows = traffic_table(cfg)
    checks = compare_with_published(rows) if not ov else []
    data = {"preset": name, "rows": [r.as_dict() for r in rows],
            "sources": field_sources(cfg),
            "published_checks": [c.__dict__ for c in checks]}
    if as_json:
        print(json.dumps(data, indent=2, default=str))
        return 0
    console = Console(width=160)
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


# ---- schedule -------------------------------------------------------------------------------


def schedule_command(args: list[str], as_json: bool) -> int:
    from .schedules import SCHEDULES, ScheduleError, simulate, validate
    from .schedules.render import grid_text, summary

    if not args or "=" in args[0]:
        raise ConfigError(f"schedule needs a NAME first (choose from {', '.join(SCHEDULES)})")
    name, rest = args[0], parse_overrides(args[1:])
    if name not in SCHEDULES:
        raise ConfigError(f"schedule={name!r} is not known (choose from "
                          f"{', '.join(SCHEDULES)})")
    ints = {k: _num(k, rest.pop(k), integer=True) for k in ("p", "m", "v") if k in rest}
    costs = {k: _num(k, rest.pop(k)) for k in ("tf", "tb", "tw", "p2p") if k in rest}
    if "overlap" in rest:  # DualPipe: run each F&B pair as one unit (DeepSeek-V3 Table 2)
        costs["overlap"] = rest.pop("overlap").lower() in ("1", "true", "yes")
    if rest:
        raise ConfigError(f"unknown key {next(iter(rest))!r} for schedule (p, m, v, tf, tb, tw, "
                          "p2p, overlap)")
    try:
        sched = SCHEDULES[name](ints.get("p", 4), ints.get("m", 8), ints.get("v", 1)) \
            if "v" in ints else SCHEDULES[name](ints.get("p", 4), ints.get("m", 8))
        validate(sched)
        sim = simulate(sched, **costs)
    except ScheduleError as e:
        raise ConfigError(str(e)) from None
    data = summary(sched, sim)
    if as_json:
        print(json.dumps(data, indent=2, default=str))
    else:
        print(grid_text(sched, sim))
        for k, v in data.items():
            if not isinstance(v, (list, dict)):
                print(f"{k}: {v}")
            else:
                print(f"{k}: {json.dumps(v, default=str)}")
    return 0
