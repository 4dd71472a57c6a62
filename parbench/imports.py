"""Importing configurations: Megatron-LM command-line arguments and DeepSpeed JSON configs.

Reachable from the command line: ``parbench run suite=data deepspeed_config=ds.json`` and
``parbench estimate megatron_args="--num-layers 96 --hidden-size 12288 ..."``.
"""
from __future__ import annotations

import dataclasses
import json
import shlex
from typing import Any

from dataclasses import replace

from .config import CaseConfig, ConfigError, RunConfig
from .layout import Layout
from .options import Options
from .overrides import apply_overrides, coerce

# imports from Megatron arguments and DeepSpeed JSON
# --------------------------------------------------------------------------------------

_MEGATRON_ARGS = {
    "--tensor-model-parallel-size": ("layout", "tp"),
    "--pipeline-model-parallel-size": ("layout", "pp"),
    "--context-parallel-size": ("layout", "cp"),
    "--expert-model-parallel-size": ("layout", "ep"),
    "--micro-batch-size": ("layout", "micro_batch_size"),
    "--num-layers": ("model", "num_layers"),
    "--hidden-size": ("model", "hidden_size"),
    "--num-attention-heads": ("model", "num_heads"),
    "--ffn-hidden-size": ("model", "ffn_hidden_size"),
    "--seq-length": ("model", "seq_length"),
    "--num-experts": ("model", "num_experts"),
    "--moe-router-topk": ("model", "moe_top_k"),
    "--vocab-size": ("model", "vocab_size"),
    "--clip-grad": ("run", "clip_grad"),
}
#: Megatron arguments whose value is a float (the others are integers)
_MEGATRON_FLOATS = frozenset({"--clip-grad"})


#: Megatron flags without a value: name -> the bare field it sets
_MEGATRON_FLAGS = {"--sequence-parallel": "sp",
                   "--untie-embeddings-and-output-weights": "tie_embeddings"}
#: Megatron arguments that derive a layout field from the others
_MEGATRON_DERIVED = {"--global-batch-size": "num_microbatches",
                     "--num-layers-per-virtual-pipeline-stage": "vpp"}


def megatron_values(argv: list[str]) -> dict[str, Any]:
    """Megatron argument -> its value (an integer; ``True`` for a flag), in the order given;
    ``--key value`` and ``--key=value`` both read."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        key, _, inline = argv[i].partition("=")
        if key in _MEGATRON_FLAGS:
            out[key] = True
            i += 1
            continue
        if key not in _MEGATRON_ARGS and key not in _MEGATRON_DERIVED:
            raise ConfigError(f"Megatron argument {key!r} is not supported")
        if inline:
            value, i = inline, i + 1
        elif i + 1 < len(argv):
            value, i = argv[i + 1], i + 2
        else:
            raise ConfigError(f"Megatron argument {key!r} needs a value")
        out[key] = coerce(value, float if key in _MEGATRON_FLOATS else int, key)
    return out


def _case_fields(args: dict[str, Any]) -> dict[str, Any]:
    """The bare case fields Megatron arguments set directly (ffn 0 = 4h unless given; the
    embeddings tied unless untied, as Megatron ties them)."""
    vals = {_MEGATRON_ARGS[k][1]: v for k, v in args.items() if k in _MEGATRON_ARGS}
    if args.get("--sequence-parallel"):
        vals["sp"] = True
    vals["tie_embeddings"] = not args.get("--untie-embeddings-and-output-weights", False)
    vals.setdefault("ffn_hidden_size", 0)
    return vals


def _derived_layout(case: CaseConfig, args: dict[str, Any],
                    world_size: int | None) -> Layout:
    """dp from the world, vpp from the layers per virtual stage, the micro-batches from the
    global batch (in that order: the global batch is per dp)."""
    lay = case.layout
    if world_size is not None:
        denom = lay.tp * lay.cp * lay.pp
        if world_size % denom:
            raise ConfigError(f"world_size={world_size} is not a multiple of tp*cp*pp={denom}")
        lay = replace(lay, dp=world_size // denom)
    per_vstage = args.get("--num-layers-per-virtual-pipeline-stage")
    if per_vstage:
        per_stage = case.model.num_layers // lay.pp
        if per_stage % per_vstage:
            raise ConfigError(f"--num-layers-per-virtual-pipeline-stage={per_vstage} "
                              f"does not divide num_layers/pp={per_stage}")
        lay = replace(lay, vpp=per_stage // per_vstage)
    gbs = args.get("--global-batch-size")
    if gbs is not None:
        try:
            lay = lay.with_global_batch(gbs)
        except ConfigError as e:
            raise ConfigError(f"--global-batch-size={gbs}: {e}") from None
    return lay


def from_megatron_args(argv: list[str], world_size: int | None = None) -> CaseConfig:
    """Build a case from Megatron-LM command line arguments.

    dp is inferred as world / (tp * cp * pp) when ``world_size`` is given, otherwise from
    ``--global-batch-size / (--micro-batch-size * num_microbatches)`` is not possible without
    the world, so dp defaults to 1. ``--num-layers-per-virtual-pipeline-stage`` gives
    vpp = num_layers / (pp * layers_per_virtual_stage). ``--global-batch-size`` sets the
    number of micro-batches per data-parallel rank = gbs / (mbs * dp).
    """
    args = megatron_values(argv)
    case = apply_overrides(CaseConfig(), _case_fields(args))
    return replace(case, layout=_derived_layout(case, args, world_size))


def from_deepspeed_json(cfg: dict | str, world_size: int = 1) -> CaseConfig:
    """Build a case from a DeepSpeed config (dict or JSON text/path).

    Reads ``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps``,
    ``train_batch_size`` (checked: = micro * accum * dp), ``zero_optimization.stage``,
    ``bf16``/``fp16``, ``optimizer`` and ``gradient_clipping`` (``clip_grad``). dp = world_size (no model parallelism in the JSON).
    """
    cfg = _load_json(cfg)
    rc = RunConfig()
    mb = cfg.get("train_micro_batch_size_per_gpu")
    ga = cfg.get("gradient_accumulation_steps")
    tb = cfg.get("train_batch_size")
    if mb is None and tb is not None and ga is not None:
        mb = tb // (ga * world_size)
    if ga is None and tb is not None and mb is not None:
        ga = tb // (mb * world_size)
    lay = Layout(dp=world_size, micro_batch_size=int(mb or 1), num_microbatches=int(ga or 1))
    if tb is not None and tb != lay.global_batch_size:
        raise ConfigError(f"train_batch_size={tb} != train_micro_batch_size_per_gpu*"
                          f"gradient_accumulation_steps*world_size="
                          f"{lay.micro_batch_size}*{lay.num_microbatches}*{world_size}")
    zero = int(cfg.get("zero_optimization", {}).get("stage", 0))
    if cfg.get("fp16", {}).get("enabled"):
        raise ConfigError("fp16.enabled=true is not supported (parbench runs fp32 or bf16)")
    if cfg.get("bf16", {}).get("enabled"):
        rc.dtype = "bf16"
    opt = cfg.get("optimizer")
    if opt:
        kind = str(opt.get("type", "")).lower()
        if kind in ("adamw", "adam"):
            rc.optimizer = "adamw"
        elif kind == "sgd":
            rc.optimizer = "sgd"
        else:
            raise ConfigError(f"optimizer.type={opt.get('type')!r} must be AdamW or SGD")
        params = opt.get("params", {})
        rc.lr = float(params.get("lr", rc.lr))
        rc.weight_decay = float(params.get("weight_decay", rc.weight_decay))
        if "betas" in params:
            rc.beta1, rc.beta2 = (float(x) for x in params["betas"])
        rc.eps = float(params.get("eps", rc.eps))
    rc.clip_grad = float(cfg.get("gradient_clipping", rc.clip_grad))
    return CaseConfig(layout=lay, options=Options().with_values(zero_stage=zero), run=rc)


def megatron_overrides(text: str) -> dict[str, str]:
    """``key=value`` overrides (model, layout and option fields) from a Megatron argument
    string: every field the arguments set or derive, and any other that differs from a
    default case's."""
    argv = shlex.split(text)
    case = from_megatron_args(argv)
    args = megatron_values(argv)
    given = set(_case_fields(args)) - {"ffn_hidden_size"} \
        | {_MEGATRON_DERIVED[k] for k in args if k in _MEGATRON_DERIVED}
    if "--ffn-hidden-size" in args:
        given.add("ffn_hidden_size")
    out: dict[str, str] = {}
    base = CaseConfig()
    for sec in ("model", "layout"):
        for f in dataclasses.fields(getattr(case, sec)):
            v = getattr(getattr(case, sec), f.name)
            if f.name in given or v != getattr(getattr(base, sec), f.name):
                out[f"{sec}.{f.name}"] = str(v).lower() if isinstance(v, bool) else str(v)
    if case.options.tensor.sp:
        out["tensor.sp"] = "true"
    if "--clip-grad" in args:
        out["run.clip_grad"] = str(case.run.clip_grad)
    return out


def deepspeed_overrides(path_or_text: str, world_size: int | None = None) -> dict[str, str]:
    """``key=value`` overrides from a DeepSpeed JSON config: batch sizes, ZeRO stage, dtype and
    optimizer. Fields the JSON does not set are left to the suite."""
    cfg = _load_json(path_or_text)
    case = from_deepspeed_json(cfg, world_size or 1)
    out: dict[str, str] = {}
    if "train_micro_batch_size_per_gpu" in cfg or "train_batch_size" in cfg:
        out["layout.micro_batch_size"] = str(case.layout.micro_batch_size)
    if "gradient_accumulation_steps" in cfg or "train_batch_size" in cfg:
        out["layout.num_microbatches"] = str(case.layout.num_microbatches)
    if "zero_optimization" in cfg:
        out["data.zero_stage"] = str(case.options.data.zero_stage)
    if cfg.get("bf16", {}).get("enabled"):
        out["run.dtype"] = "bf16"
    if cfg.get("optimizer"):
        for name in ("optimizer", "lr", "weight_decay", "beta1", "beta2", "eps"):
            out[f"run.{name}"] = str(getattr(case.run, name))
    if "gradient_clipping" in cfg:
        out["run.clip_grad"] = str(case.run.clip_grad)
    return out


def _load_json(cfg: dict | str) -> dict:
    if isinstance(cfg, dict):
        return cfg
    text = cfg
    if not cfg.lstrip().startswith("{"):
        try:
            with open(cfg) as fh:
                text = fh.read()
        except OSError as e:
            raise ConfigError(f"deepspeed_config={cfg!r} cannot be read ({e.strerror})") from None
    try:
        out = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"deepspeed_config={cfg!r} is not valid JSON ({e.msg}, line "
                          f"{e.lineno})") from None
    if not isinstance(out, dict):
        raise ConfigError(f"deepspeed_config={cfg!r} must hold a JSON object")
    return out
