"""Configuration: model, parallel and run settings as dataclasses.

Validation names the field, the value and the rule it breaks, and runs before any rank is
spawned. Overrides are ``key=value`` strings with dotted keys (``parallel.pp=4``); bare keys
are looked up in every section (``pp=4`` reaches ``parallel.pp``). Megatron-style command
line arguments and DeepSpeed JSON configs can be imported.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field, fields, replace
from typing import Any


class ConfigError(ValueError):
    """A bad setting: the message names the field, the value and the rule."""


# --------------------------------------------------------------------------------------
# dataclasses
# --------------------------------------------------------------------------------------


@dataclass
class ModelConfig:
    """Shape of the reference GPT decoder (pre-LN, learned positions, 4h MLP by default)."""

    name: str = "custom"
    vocab_size: int = 128
    hidden_size: int = 32
    num_layers: int = 2
    num_heads: int = 4
    ffn_hidden_size: int = 0  # 0 means 4 * hidden_size
    seq_length: int = 16
    tie_embeddings: bool = False
    position_embeddings: bool = True
    num_experts: int = 0  # 0 = dense
    moe_top_k: int = 1
    init_std: float = 0.02

    def __post_init__(self) -> None:
        if not self.ffn_hidden_size:
            self.ffn_hidden_size = 4 * self.hidden_size

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass
class ParallelConfig:
    """Degrees of every parallelism axis and the pipeline / data-parallel options.

    Megatron-Core layout: world = tp * cp * dp * pp (tp fastest, pp slowest); ep re-partitions
    the tp * cp * dp ranks of a stage and is not a further factor of the world.
    """

    tp: int = 1
    cp: int = 1
    ep: int = 1
    dp: int = 1
    pp: int = 1
    vpp: int = 1  # virtual stages (chunks) per pipeline rank
    sp: bool = False  # Megatron sequence parallelism (with tp)
    micro_batch_size: int = 2
    num_microbatches: int = 1  # per data-parallel rank per step (gradient accumulation / pipeline m)
    schedule: str = "1f1b"
    zero_stage: int = 0
    bucket_mb: float = 0.25  # DDP/ZeRO gradient bucket size in MiB
    local_sgd_period: int = 2  # H: average every H steps (local SGD)

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.num_microbatches * self.dp


@dataclass
class RunConfig:
    """What to run and how: scheme, steps, optimizer, device, output."""

    scheme: str = "data.ddp"
    steps: int = 3
    warmup_steps: int = 1  # extra timed steps discarded before medians (benchmarks only)
    timed_steps: int = 0  # extra steps after the checked ones, only timed
    seed: int = 1234
    optimizer: str = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    dtype: str = "fp32"  # fp32 | bf16 (compute dtype; master weights fp32)
    device: str = "cpu"  # cpu | cuda
    threads_per_rank: int = 1
    timeout_s: float = 120.0  # collective timeout
    # Tolerances (fp32). Losses and gradients: rtol 1e-5, atol 1e-6 -- reduction order is the
    # only difference. Parameters after AdamW: atol 1e-4 (a tenth of one step at the default
    # lr 1e-3): AdamW's update lr*m/(sqrt(v)+eps) turns a reduction-order difference d in a
    # gradient near eps into an update difference of up to lr*d/eps, i.e. a fraction of lr
    # (seen: 1.7e-5 for DDP on 3 ranks against the golden run). Pure data movement is checked exactly (atol 0) by the schemes'
    # own tests. Gradients of step 0 (identical weights) use atol; gradients of later steps
    # are computed on weights that already differ by up to param_atol and use param_atol.
    # Every comparison is tensor-wise: max|ours - golden| <= atol + rtol * max|golden|.
    rtol: float = 1e-5
    atol: float = 1e-6
    param_atol: float = 1e-4
    fail_at_step: int = -1  # testing aid: rank `fail_rank` raises at this step
    fail_rank: int = 0


@dataclass
class CaseConfig:
    """One case of a suite: model + parallel + run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    run: RunConfig = field(default_factory=RunConfig)
    id: str = ""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "CaseConfig":
        return cls(
            model=ModelConfig(**d.get("model", {})),
            parallel=ParallelConfig(**d.get("parallel", {})),
            run=RunConfig(**d.get("run", {})),
            id=d.get("id", ""),
        )


SECTIONS = ("model", "parallel", "run")

# --------------------------------------------------------------------------------------
# presets
# --------------------------------------------------------------------------------------

#: Named model shapes. Tiny ones run on local CPU ranks; real ones feed the analytic model.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=128, hidden_size=32, num_layers=2, num_heads=4, seq_length=16),
    "tiny-4l": dict(vocab_size=128, hidden_size=32, num_layers=4, num_heads=4, seq_length=16),
    "tiny-8l": dict(vocab_size=128, hidden_size=32, num_layers=8, num_heads=4, seq_length=16),
    "small": dict(vocab_size=512, hidden_size=128, num_layers=4, num_heads=8, seq_length=64),
    "bench": dict(vocab_size=1024, hidden_size=256, num_layers=8, num_heads=8, seq_length=128),
    # Brown et al. 2020, Table 2.1; vocabulary 50257 padded to 51200 as Megatron pads it
    # (a multiple of 128 * tp) so vocab-parallel layers split evenly
    "gpt3-175b": dict(vocab_size=51200, hidden_size=12288, num_layers=96, num_heads=96,
                      seq_length=2048, tie_embeddings=True),
    # Touvron et al. 2023 (LLaMA-2); SwiGLU is approximated by a 2-matrix MLP with the same
    # parameter count (3 * h * f_swiglu = 2 * h * f  =>  f = 1.5 * f_swiglu).
    "llama2-7b": dict(vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32,
                      ffn_hidden_size=16512, seq_length=4096, position_embeddings=False),
    "llama2-70b": dict(vocab_size=32000, hidden_size=8192, num_layers=80, num_heads=64,
                       ffn_hidden_size=43008, seq_length=4096, position_embeddings=False),
    # UB-Mesh (arXiv 2503.20377) Table 5 "GPT4-2T"-like MoE: 96 layers, 96 heads of 128,
    # hidden 12288, 16 experts (sourced); seq 8192 per rank and top-1 are inferred from Table 1.
    "ubmesh-moe-2t": dict(vocab_size=100000, hidden_size=12288, num_layers=96, num_heads=96,
                          seq_length=8192, num_experts=16, moe_top_k=1,
                          position_embeddings=False),
}

LOCAL_PRESETS = ("tiny", "tiny-4l", "tiny-8l", "small", "bench")


def model_preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError(f"model={name!r} is not a preset (choose from {', '.join(PRESETS)})")
    return ModelConfig(name=name, **PRESETS[name])


# --------------------------------------------------------------------------------------
# overrides
# --------------------------------------------------------------------------------------


def _coerce(value: str, target_type: Any, key: str) -> Any:
    t = target_type if isinstance(target_type, type) else {"int": int, "float": float,
                                                           "bool": bool, "str": str}.get(
        str(target_type), str)
    if t is bool:
        if isinstance(value, bool):
            return value
        low = str(value).lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{key}={value!r} is not a boolean (use true/false)")
    if t is int:
        try:
            f = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}={value!r} is not an integer") from None
        if f != int(f):
            raise ConfigError(f"{key}={value!r} is not an integer")
        return int(f)
    if t is float:
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}={value!r} is not a number") from None
    return str(value)


def _field_types(obj) -> dict[str, Any]:
    return {f.name: f.type for f in fields(obj)}


def parse_overrides(args: list[str]) -> dict[str, str]:
    """``["a=1", "parallel.pp=2"]`` -> ``{"a": "1", "parallel.pp": "2"}``."""
    out: dict[str, str] = {}
    for a in args:
        if "=" not in a:
            raise ConfigError(f"argument {a!r} is not of the form key=value")
        k, v = a.split("=", 1)
        if not k:
            raise ConfigError(f"argument {a!r} has an empty key")
        out[k.strip()] = v.strip()
    return out


def apply_overrides(case: CaseConfig, overrides: dict[str, Any]) -> CaseConfig:
    """Return a copy of ``case`` with ``key=value`` overrides applied.

    ``model=PRESET`` selects a preset first; dotted keys name a section; bare keys are
    looked up in model, parallel, run (in that order) and must be unique.
    """
    sections = {s: dataclasses.asdict(getattr(case, s)) for s in SECTIONS}
    types = {s: _field_types(getattr(case, s)) for s in SECTIONS}
    ov = dict(overrides)
    preset = ov.pop("model", None)
    if preset is not None:
        base = dataclasses.asdict(model_preset(str(preset)))
        sections["model"] = base
    for key, value in ov.items():
        if "." in key:
            sec, name = key.split(".", 1)
            if sec not in SECTIONS:
                raise ConfigError(f"unknown key {key!r}: section {sec!r} is not one of "
                                  f"{', '.join(SECTIONS)}")
            if name not in types[sec]:
                raise ConfigError(f"unknown key {key!r}: {sec} has no field {name!r}")
        else:
            hits = [s for s in SECTIONS if key in types[s]]
            if not hits:
                raise ConfigError(f"unknown key {key!r} (see `parbench list` for the fields)")
            sec, name = hits[0], key
        sections[sec][name] = _coerce(value, types[sec][name], key)
    return CaseConfig(model=ModelConfig(**sections["model"]),
                      parallel=ParallelConfig(**sections["parallel"]),
                      run=RunConfig(**sections["run"]), id=case.id)


# --------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------


def _positive(obj, names) -> None:
    for n in names:
        v = getattr(obj, n)
        if v < 1:
            raise ConfigError(f"{n}={v} must be >= 1")


def validate_model(m: ModelConfig) -> None:
    _positive(m, ("vocab_size", "hidden_size", "num_layers", "num_heads", "ffn_hidden_size",
                  "seq_length", "moe_top_k"))
    if m.hidden_size % m.num_heads:
        raise ConfigError(f"num_heads={m.num_heads} does not divide hidden_size={m.hidden_size}")
    if m.num_experts < 0:
        raise ConfigError(f"num_experts={m.num_experts} must be >= 0")
    if m.num_experts and m.moe_top_k > m.num_experts:
        raise ConfigError(f"moe_top_k={m.moe_top_k} exceeds num_experts={m.num_experts}")


def validate_parallel(p: ParallelConfig, m: ModelConfig) -> None:
    _positive(p, ("tp", "cp", "ep", "dp", "pp", "vpp", "micro_batch_size", "num_microbatches",
                  "local_sgd_period"))
    if m.num_heads % p.tp:
        raise ConfigError(f"tp={p.tp} does not divide num_heads={m.num_heads}")
    if m.ffn_hidden_size % p.tp:
        raise ConfigError(f"tp={p.tp} does not divide ffn_hidden_size={m.ffn_hidden_size}")
    if m.vocab_size % p.tp:
        raise ConfigError(f"tp={p.tp} does not divide vocab_size={m.vocab_size}")
    if m.seq_length % p.cp:
        raise ConfigError(f"cp={p.cp} does not divide seq_length={m.seq_length}")
    if p.sp and p.tp > 1 and m.seq_length % p.tp:
        raise ConfigError(f"sp with tp={p.tp} needs tp to divide seq_length={m.seq_length}")
    if (p.cp * p.dp) % p.ep:
        raise ConfigError(f"ep={p.ep} does not divide cp*dp={p.cp * p.dp} "
                          "(expert parallelism re-partitions the tp*cp*dp ranks of a stage)")
    if p.ep > 1 and m.num_experts % p.ep:
        raise ConfigError(f"ep={p.ep} does not divide num_experts={m.num_experts}")
    if m.num_layers % (p.pp * p.vpp):
        raise ConfigError(f"pp*vpp={p.pp * p.vpp} does not divide num_layers={m.num_layers}")
    if p.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"zero_stage={p.zero_stage} must be 0, 1, 2 or 3")
    if p.bucket_mb <= 0:
        raise ConfigError(f"bucket_mb={p.bucket_mb} must be > 0")


def validate_run(r: RunConfig) -> None:
    if r.steps < 1:
        raise ConfigError(f"steps={r.steps} must be >= 1")
    if r.optimizer not in ("adamw", "sgd"):
        raise ConfigError(f"optimizer={r.optimizer!r} must be adamw or sgd")
    if r.dtype not in ("fp32", "bf16"):
        raise ConfigError(f"dtype={r.dtype!r} must be fp32 or bf16")
    if r.device not in ("cpu", "cuda"):
        raise ConfigError(f"device={r.device!r} must be cpu or cuda")
    if r.lr <= 0:
        raise ConfigError(f"lr={r.lr} must be > 0")
    if r.threads_per_rank < 1:
        raise ConfigError(f"threads_per_rank={r.threads_per_rank} must be >= 1")


def validate_case(c: CaseConfig, world_size: int | None = None) -> None:
    """Check a case before anything is spawned; ``world_size`` is checked if given."""
    validate_model(c.model)
    validate_parallel(c.parallel, c.model)
    validate_run(c.run)
    if world_size is not None and world_size != c.parallel.world_size:
        p = c.parallel
        raise ConfigError(f"world_size={world_size} does not match tp*cp*dp*pp="
                          f"{p.tp}*{p.cp}*{p.dp}*{p.pp}={p.world_size}")


# --------------------------------------------------------------------------------------
# imports from Megatron arguments and DeepSpeed JSON
# --------------------------------------------------------------------------------------

_MEGATRON_ARGS = {
    "--tensor-model-parallel-size": ("parallel", "tp"),
    "--pipeline-model-parallel-size": ("parallel", "pp"),
    "--context-parallel-size": ("parallel", "cp"),
    "--expert-model-parallel-size": ("parallel", "ep"),
    "--micro-batch-size": ("parallel", "micro_batch_size"),
    "--num-layers": ("model", "num_layers"),
    "--hidden-size": ("model", "hidden_size"),
    "--num-attention-heads": ("model", "num_heads"),
    "--ffn-hidden-size": ("model", "ffn_hidden_size"),
    "--seq-length": ("model", "seq_length"),
    "--num-experts": ("model", "num_experts"),
    "--moe-router-topk": ("model", "moe_top_k"),
    "--vocab-size": ("model", "vocab_size"),
}


def from_megatron_args(argv: list[str], world_size: int | None = None) -> CaseConfig:
    """Build a case from Megatron-LM command line arguments.

    dp is inferred as world / (tp * cp * pp) when ``world_size`` is given, otherwise from
    ``--global-batch-size / (--micro-batch-size * num_microbatches)`` is not possible without
    the world, so dp defaults to 1. ``--num-layers-per-virtual-pipeline-stage`` gives
    vpp = num_layers / (pp * layers_per_virtual_stage). ``--global-batch-size`` sets the
    number of micro-batches per data-parallel rank = gbs / (mbs * dp).
    """
    vals: dict[tuple[str, str], Any] = {}
    gbs = None
    layers_per_vstage = None
    flags = {"--sequence-parallel": ("parallel", "sp"),
             "--untie-embeddings-and-output-weights": None}
    tie = True
    i = 0
    while i < len(argv):
        a = argv[i]
        key, _, inline = a.partition("=")
        if key in flags:
            if key == "--sequence-parallel":
                vals[("parallel", "sp")] = True
            else:
                tie = False
            i += 1
            continue
        known = key in _MEGATRON_ARGS or key in ("--global-batch-size",
                                                 "--num-layers-per-virtual-pipeline-stage")
        if not known:
            raise ConfigError(f"Megatron argument {key!r} is not supported")
        if inline:
            value = inline
            i += 1
        else:
            if i + 1 >= len(argv):
                raise ConfigError(f"Megatron argument {key!r} needs a value")
            value = argv[i + 1]
            i += 2
        if key == "--global-batch-size":
            gbs = _coerce(value, int, key)
        elif key == "--num-layers-per-virtual-pipeline-stage":
            layers_per_vstage = _coerce(value, int, key)
        else:
            vals[_MEGATRON_ARGS[key]] = _coerce(value, int, key)
    case = CaseConfig()
    model = dataclasses.asdict(case.model)
    par = dataclasses.asdict(case.parallel)
    model["tie_embeddings"] = tie
    model["ffn_hidden_size"] = 0
    for (sec, name), v in vals.items():
        (model if sec == "model" else par)[name] = v
    mc = ModelConfig(**model)
    pc = ParallelConfig(**par)
    if world_size is not None:
        denom = pc.tp * pc.cp * pc.pp
        if world_size % denom:
            raise ConfigError(f"world_size={world_size} is not a multiple of tp*cp*pp={denom}")
        pc.dp = world_size // denom
    if layers_per_vstage:
        per_stage = mc.num_layers // pc.pp
        if per_stage % layers_per_vstage:
            raise ConfigError(f"--num-layers-per-virtual-pipeline-stage={layers_per_vstage} "
                              f"does not divide num_layers/pp={per_stage}")
        pc.vpp = per_stage // layers_per_vstage
    if gbs is not None:
        per = pc.micro_batch_size * pc.dp
        if gbs % per:
            raise ConfigError(f"--global-batch-size={gbs} is not a multiple of "
                              f"micro_batch_size*dp={per}")
        pc.num_microbatches = gbs // per
    return CaseConfig(model=mc, parallel=pc, run=RunConfig())


def from_deepspeed_json(cfg: dict | str, world_size: int = 1) -> CaseConfig:
    """Build a case from a DeepSpeed config (dict or JSON text/path).

    Reads ``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps``,
    ``train_batch_size`` (checked: = micro * accum * dp), ``zero_optimization.stage``,
    ``bf16``/``fp16`` and ``optimizer``. dp = world_size (no model parallelism in the JSON).
    """
    if isinstance(cfg, str):
        text = cfg
        if not cfg.lstrip().startswith("{"):
            with open(cfg) as fh:
                text = fh.read()
        cfg = json.loads(text)
    pc = ParallelConfig(dp=world_size)
    rc = RunConfig()
    mb = cfg.get("train_micro_batch_size_per_gpu")
    ga = cfg.get("gradient_accumulation_steps")
    tb = cfg.get("train_batch_size")
    if mb is None and tb is not None and ga is not None:
        mb = tb // (ga * world_size)
    if ga is None and tb is not None and mb is not None:
        ga = tb // (mb * world_size)
    pc.micro_batch_size = int(mb or 1)
    pc.num_microbatches = int(ga or 1)
    if tb is not None and tb != pc.micro_batch_size * pc.num_microbatches * world_size:
        raise ConfigError(f"train_batch_size={tb} != train_micro_batch_size_per_gpu*"
                          f"gradient_accumulation_steps*world_size="
                          f"{pc.micro_batch_size}*{pc.num_microbatches}*{world_size}")
    pc.zero_stage = int(cfg.get("zero_optimization", {}).get("stage", 0))
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
    return CaseConfig(parallel=pc, run=rc)


def with_changes(case: CaseConfig, **sections: dict) -> CaseConfig:
    """Copy of ``case`` with per-section field changes: ``with_changes(c, run={'steps': 2})``."""
    return CaseConfig(
        model=replace(case.model, **sections.get("model", {})),
        parallel=replace(case.parallel, **sections.get("parallel", {})),
        run=replace(case.run, **sections.get("run", {})),
        id=case.id,
    )
