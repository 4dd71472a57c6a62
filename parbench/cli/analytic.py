"""The analytic verbs of the command line: ``estimate`` and ``traffic``.

Each turns ``key=value`` arguments into a call of the pure functions in
``parbench.analytic`` and renders the result (rich tables, or JSON
with ``--json``). Nothing here spawns a rank.

``estimate`` reads the model, layout and option fields through the one field table
(:func:`parbench.overrides.apply_overrides`: bare or dotted keys, ``zero=``, the same one-line
error as ``run``), and its own keys (``parbench estimate --help``) into a
:class:`~parbench.analytic.Counting` and the time model's device.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, replace
from typing import Any

from rich.table import Table

from ..analytic.counting import Counting
from ..config import CaseConfig, ConfigError, ModelConfig, model_preset, validate_model
from ..overrides import apply_overrides, coerce, number, parse_overrides, resolve_key
from ..report import fmt_bytes
from .help import own_keys
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


def _render_sections(est, title: str, console) -> None:
    """One table per block of the estimate, every figure a row."""
    for section, block in est.sections():
        body = block.as_dict() if hasattr(block, "as_dict") else block
        t = Table(title=f"{title}: {section}", show_header=False)
        t.add_column("quantity", style="cyan")
        t.add_column("value")
        for k, v in _walk(body):
            t.add_row(k, _fmt(k, v))
        console.print(t)


# ---- estimate: the command line -------------------------------------------------------------

#: logits_dtype= -> bytes per logit (the last stage's cross-entropy input)
_LOGITS_DTYPES = {"fp32": 4, "bf16": 2, "fp16": 2}
#: help keys that are case fields, read through the field table (not popped as own keys)
_CASE_KEYS = ("model", "schedule")


def _own_key_names() -> tuple[str, ...]:
    return tuple(k for k in own_keys("estimate") if k not in _CASE_KEYS)


@dataclass(frozen=True)
class EstimateArgs:
    """``parbench estimate``'s arguments, parsed: the case (its model, layout and options),
    how to count, and the verb's own choices. ``params``: a bare parameter count instead of
    the model (the ZeRO paper's examples)."""

    case: CaseConfig
    counting: Counting
    params: float | None = None
    device: str | None = None
    device_gb: float | None = None
    verbose: bool = False


def _unknown(key: str) -> ConfigError:
    return ConfigError(f"{key}: not a key of estimate (keys: {', '.join(own_keys('estimate'))}"
                       "; and the model, layout and option fields of `parbench run --help`)")


def _given_fields(ov: dict[str, str]) -> set[str]:
    """The bare field names of the case keys given; run fields and unknown keys refused."""
    names = set()
    for k in ov:
        try:
            info = resolve_key(k)
        except ConfigError:
            raise _unknown(k) from None
        if info.section == "run":
            raise _unknown(k)
        names.add(info.name)
    return names


def _import_megatron(ov: dict[str, str], text: str) -> tuple[str, str | None]:
    """Megatron-LM arguments as case keys (their run fields, optimizer and dtype, are not
    estimate's: dropped); a key given on the command line wins; the ignored ones on stderr.
    Returns the attention they run (``imports.megatron_attention``) and their precision
    (``--bf16`` / ``--fp16``; None: neither, Megatron's fp32)."""
    import shlex
    import sys
    from ..imports import megatron_attention, megatron_ignored, megatron_overrides
    from ..megatron_args import MEGATRON_NUMERICS_ONLY, MEGATRON_NUMERICS_ONLY_FLAGS
    argv = shlex.split(text)
    ignored = megatron_ignored(argv)
    why = {**MEGATRON_NUMERICS_ONLY, **MEGATRON_NUMERICS_ONLY_FLAGS}
    if ignored:
        print("ignored Megatron arguments (they do not change what parbench computes): "
              + " ".join(f"{k} ({why[k]})" if k in why else k for k in ignored),
              file=sys.stderr)
    given = _given_fields({k: v for k, v in ov.items() if k != "model"})
    imported = megatron_overrides(text)
    for key, value in imported.items():
        if not key.startswith("run.") and resolve_key(key).name not in given:
            ov[key] = value
    ov.setdefault("model", "custom")
    return megatron_attention(argv), imported.get("run.dtype")


def _case(ov: dict[str, str], with_model: bool) -> CaseConfig:
    """The case the keys describe, on the planner's defaults (one sequence per micro-batch,
    25 MiB buckets); ``model=custom``: the default model's fields."""
    from ..timemodel import Training
    base = Training()
    preset = ov.pop("model", "gpt3-175b") if with_model else "custom"
    given = _given_fields(ov)
    if not with_model and given & {f.name for f in dataclasses.fields(ModelConfig)}:
        bad = next(k for k in ov if resolve_key(k).section == "model")
        raise ConfigError(f"{bad}={ov[bad]} has no meaning with params= (give model=PRESET "
                          "instead)")
    model = ModelConfig() if preset == "custom" else model_preset(preset)
    case = apply_overrides(CaseConfig(model=model, layout=base.layout, options=base.options),
                           ov)
    if with_model:
        validate_model(case.model)
    lay = case.layout
    if lay.vpp > 1 and "schedule" not in given:
        case = replace(case, layout=replace(lay, schedule="interleaved"))
    return case


def _with_global_batch(case: CaseConfig, value: str, given: set[str]) -> CaseConfig:
    """``global_batch_size=B``: m = B / (b dp) micro-batches (checked against
    ``num_microbatches`` when both are given)."""
    lay = case.layout.with_global_batch(number("global_batch_size", value, integer=True,
                                               minimum=1))
    if "num_microbatches" in given and lay.num_microbatches != case.layout.num_microbatches:
        raise ConfigError(f"num_microbatches={case.layout.num_microbatches} does not match "
                          f"global_batch_size/(micro_batch_size*dp)={lay.num_microbatches}")
    return replace(case, layout=lay)


def _counting(own: dict[str, str], with_model: bool) -> Counting:
    """How to count, from the own keys dtype / bytes_per_element, accounting, attention,
    causal_flops, logits_dtype and generate."""
    kw: dict[str, Any] = {k: own[k] for k in ("accounting", "attention", "causal_flops")
                          if k in own}
    if "logits_dtype" in own:
        if own["logits_dtype"] not in _LOGITS_DTYPES:
            raise ConfigError(f"logits_dtype={own['logits_dtype']!r} must be fp32, bf16 or "
                              "fp16")
        kw["logits_bytes"] = _LOGITS_DTYPES[own["logits_dtype"]]
    if "generate" in own:
        if not with_model:
            raise ConfigError(f"generate={own['generate']} needs a model (give model=PRESET, "
                              "not params=)")
        kw["generate"] = number("generate", own["generate"], integer=True, minimum=0)
    if "bytes_per_element" in own:
        kw["bytes_per_element"] = number("bytes_per_element", own["bytes_per_element"],
                                         integer=True, minimum=1)
    elif "dtype" in own:
        return Counting.of_dtype(own["dtype"], **kw)
    return Counting(**kw)


def parse_estimate(args: list[str]) -> EstimateArgs:
    """``parbench estimate``'s ``key=value`` arguments, checked."""
    ov = parse_overrides(args)
    own = {k: ov.pop(k) for k in list(ov) if k in _own_key_names()}
    if own.get("megatron_args"):
        attention, dtype = _import_megatron(ov, own["megatron_args"])
        own.setdefault("attention", attention)
        if dtype is not None and "bytes_per_element" not in own:
            own.setdefault("dtype", dtype)
    psi = None
    if "params" in own:
        psi = number("params", own["params"], minimum=0, strict=True)
        if "model" in ov:
            raise ConfigError("give model=PRESET or params=N, not both")
    case = _case(ov, with_model=psi is None)
    given = _given_fields(ov)
    if "global_batch_size" in own:
        case = _with_global_batch(case, own["global_batch_size"], given)
    device = own.get("device")
    if device is not None and psi is not None:
        raise ConfigError("device= needs a model (model=PRESET or its fields), not params=")
    if "schedule" in given and device is None:
        raise ConfigError("schedule= is read by the time model: give device=PROFILE too")
    device_gb = own.get("device_gb")
    return EstimateArgs(
        case=case, counting=_counting(own, psi is None), params=psi, device=device,
        device_gb=None if device_gb is None else number("device_gb", device_gb, minimum=0,
                                                        strict=True),
        verbose=coerce(own.get("verbose", "false"), bool, "verbose"))


# ---- estimate: the figures and their output -------------------------------------------------

def _compute(a: EstimateArgs):
    """The :class:`~parbench.analytic.Estimate` (or ``ParamsEstimate``) of the arguments."""
    from ..analytic import estimate, estimate_params, shape_from
    from ..analytic.estimate_states import model_fits
    lay, opts = a.case.layout, a.case.options
    try:
        est = estimate_params(a.params, lay, opts, a.counting) if a.params is not None \
            else estimate(shape_from(a.case.model), lay, opts, a.counting)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if a.device_gb is not None:
        est = replace(est, largest_model_fits=model_fits(a.device_gb * 1e9, lay))
    return est


def _training(a: EstimateArgs):
    """The time model's :class:`Training`: the same layout and options, the counting's
    precision, accounting and attention (so the memory it checks is this estimate's)."""
    from ..timemodel import Training
    return Training(layout=a.case.layout, options=a.case.options, dtype=a.counting.dtype,
                    accounting=a.counting.accounting, attention=a.counting.attention)


def _time_model(a: EstimateArgs, trn):
    """The device profile and the predicted step (``device=``)."""
    from ..analytic import shape_from
    from ..schedules import SCHEDULES
    from ..timemodel import load_profile, predict_step
    profile = load_profile(a.device)
    if a.case.layout.schedule not in SCHEDULES:
        raise ConfigError(f"schedule={a.case.layout.schedule!r} must be one of "
                          f"{', '.join(SCHEDULES)}")
    try:
        return profile, predict_step(shape_from(a.case.model), trn, profile)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def cmd_estimate(args: list[str], as_json: bool = False, wide: bool = False) -> int:
    a = parse_estimate(args)
    est = _compute(a)
    trn = _training(a)
    profile, st = _time_model(a, trn) if a.device else (None, None)
    if as_json:
        from ..timemodel.report import as_json as time_json
        out = est.as_dict()
        if st is not None:
            out["time"] = time_json(st, trn, profile)
        print(json.dumps(out, indent=2, default=str))
        return 0
    _estimate_output(a, est, trn, st, profile, a.verbose or wide)
    return 0


def _estimate_output(a: EstimateArgs, est, trn, st, profile, verbose: bool) -> None:
    """The summary (default), the full breakdown (``verbose=true`` or ``--wide``); with
    ``device=`` the time model's step time, MFU and memory against the device."""
    from ..analytic import shape_from
    from ..timemodel.report import breakdown_rows, summary
    out = make_console()
    if a.params is not None:
        _render_sections(est, "estimate", out)
        return
    for line in summary(a.case.model.name, shape_from(a.case.model), trn, st, profile, est):
        out.print(line, highlight=False)
    if not verbose:
        out.print("  (--verbose: the full breakdown; --json: every figure)", style="dim")
        return
    _render_sections(est, "estimate", out)
    if st is not None:
        t = Table(title=f"estimate: time model on {profile.name}", show_header=False)
        t.add_column("quantity", style="cyan")
        t.add_column("value")
        for k, v in breakdown_rows(st):
            t.add_row(k, v)
        out.print(t)


# ---- traffic --------------------------------------------------------------------------------

def _traffic_config(ov: dict[str, str]) -> tuple[str, Any]:
    """The traffic preset named by ``preset=`` with its fields overridden by the other keys."""
    from ..analytic import TRAFFIC_PRESETS
    name = ov.pop("preset", "ubmesh-moe-2t")
    if name not in TRAFFIC_PRESETS:
        raise ConfigError(f"preset={name!r} is not a traffic preset (choose from "
                          f"{', '.join(TRAFFIC_PRESETS)})")
    cfg = TRAFFIC_PRESETS[name]
    if isinstance(cfg, type):
        cfg = cfg()
    fields = {f.name for f in dataclasses.fields(cfg)}
    changes = {}
    for k, v in ov.items():
        if k not in fields:
            raise ConfigError(f"unknown key {k!r} for preset {name} (fields: "
                              f"{', '.join(fields)})")
        cur = getattr(cfg, k)
        changes[k] = type(cur)(number(k, v, integer=isinstance(cur, int), minimum=0,
                                      strict=True))
    return name, dataclasses.replace(cfg, **changes)


def cmd_traffic(args: list[str], as_json: bool = False, wide: bool = False) -> int:
    from ..analytic import compare_with_published, field_sources, traffic_table
    ov = parse_overrides(args)
    changed = bool(set(ov) - {"preset"})
    name, cfg = _traffic_config(ov)
    try:
        rows = traffic_table(cfg)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    checks = compare_with_published(rows) if not changed else []
    sources = field_sources(cfg)
    if as_json:
        print(json.dumps({"preset": name, "rows": [r.as_dict() for r in rows],
                          "sources": sources,
                          "published_checks": [c.__dict__ for c in checks]},
                         indent=2, default=str))
        return 0
    _print_traffic(name, rows, checks, sources)
    return 0


def _print_traffic(name: str, rows, checks, sources: dict[str, str]) -> None:
    """The traffic table, the published cells it reproduces, and where each figure of the
    preset comes from."""
    console = make_console()
    t = Table(title=f"Traffic per parallelism, one iteration of {name} (MB = 2^20 B, "
                    "GB = 2^30 B, wire bytes per rank)")
    for col in ("parallelism", "pattern", "per transfer (MB)", "transfers", "total (GB)",
                "share"):
        t.add_column(col)
    for r in (row.as_dict() for row in rows):
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
    for k, v in sources.items():
        src.add_row(k, v)
    console.print(src)
