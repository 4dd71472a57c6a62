"""Importing a DeepSpeed JSON config as a case: ``parbench run suite=data
deepspeed_config=ds.json``."""
from __future__ import annotations

import json

from .config import CaseConfig, ConfigError, RunConfig
from .layout import Layout
from .options import Options


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
