"""Importing configurations: Megatron-LM command-line arguments and DeepSpeed JSON configs.

Reachable from the command line: ``parbench run suite=data deepspeed_config=ds.json`` and
``parbench estimate megatron_args="--num-layers 96 --hidden-size 12288 ..."``.
"""
from __future__ import annotations

import dataclasses
import json
import math
import shlex
from typing import Any

from dataclasses import replace

from .config import CaseConfig, ConfigError, RunConfig
from .layout import Layout
from .options import Options
from .overrides import apply_overrides, coerce

# imports from Megatron arguments and DeepSpeed JSON
# --------------------------------------------------------------------------------------

#: Megatron arguments with one value that set a case field: name -> (bare field, type)
_MEGATRON_ARGS = {
    "--tensor-model-parallel-size": ("tp", int), "--pipeline-model-parallel-size": ("pp", int),
    "--context-parallel-size": ("cp", int), "--expert-model-parallel-size": ("ep", int),
    "--expert-tensor-parallel-size": ("etp", int), "--micro-batch-size": ("micro_batch_size", int),
    "--num-layers": ("num_layers", int), "--hidden-size": ("hidden_size", int),
    "--num-attention-heads": ("num_heads", int), "--ffn-hidden-size": ("ffn_hidden_size", int),
    "--seq-length": ("seq_length", int), "--vocab-size": ("vocab_size", int),
    "--make-vocab-size-divisible-by": ("make_vocab_size_divisible_by", int),
    "--init-method-std": ("init_std", float), "--num-experts": ("num_experts", int),
    "--moe-router-topk": ("moe_top_k", int), "--moe-aux-loss-coeff": ("moe_aux_loss_coef", float),
    "--moe-z-loss-coeff": ("moe_z_loss_coef", float),
    "--moe-expert-capacity-factor": ("moe_capacity_factor", float),
    "--moe-layer-freq": ("moe_every", int), "--clip-grad": ("clip_grad", float),
    "--lr": ("lr", float), "--weight-decay": ("weight_decay", float),
    "--adam-beta1": ("beta1", float), "--adam-beta2": ("beta2", float),
    "--adam-eps": ("eps", float), "--seed": ("seed", int),
}
#: Megatron flags that set case fields: name -> {bare field: value}
_MEGATRON_FLAGS = {
    "--sequence-parallel": {"sp": True}, "--swiglu": {"mlp": "swiglu"},
    "--disable-bias-linear": {"bias": False}, "--bf16": {"dtype": "bf16"},
    "--untie-embeddings-and-output-weights": {"tie_embeddings": False},
    "--use-rotary-position-embeddings": {"rope_theta": 10000.0, "position_embeddings": False},
    "--no-position-embedding": {"position_embeddings": False},
}
#: Megatron arguments whose value picks fields: name -> {value: {bare field: value}}
_MEGATRON_CHOICES = {
    "--normalization": {"LayerNorm": {"norm": "layernorm"}, "RMSNorm": {"norm": "rmsnorm"}},
    "--position-embedding-type": {
        "learned_absolute": {"position_embeddings": True, "rope_theta": 0.0},
        "rope": {"position_embeddings": False, "rope_theta": 10000.0},
        "none": {"position_embeddings": False, "rope_theta": 0.0}},
    "--recompute-granularity": {"full": {"recompute": "full"},
                                "selective": {"recompute": "selective"}},
    "--moe-router-load-balancing-type": {"aux_loss": {}, "none": {"moe_aux_loss_coef": 0.0}},
    "--transformer-impl": {"local": {}, "transformer_engine": {}},
}
#: Megatron arguments read by the checks in :func:`_megatron_checks` (one value each)
_MEGATRON_CHECKED = {"--num-query-groups": int, "--rotary-base": float, "--kv-channels": int,
                     "--max-position-embeddings": int, "--rotary-percent": float,
                     "--attention-dropout": float, "--hidden-dropout": float}
_MEGATRON_CHECKED_FLAGS = frozenset({"--group-query-attention"})
#: Megatron arguments that derive a layout field from the others
_MEGATRON_DERIVED = {"--global-batch-size": "num_microbatches",
                     "--num-layers-per-virtual-pipeline-stage": "vpp"}
#: Megatron flags that do not change what parbench computes (performance, logging, checkpoints)
_MEGATRON_IGNORED_FLAGS = frozenset("--" + n for n in """
use-flash-attn use-mcore-models overlap-grad-reduce overlap-param-gather
use-distributed-optimizer cross-entropy-loss-fusion manual-gc no-masked-softmax-fusion
no-bias-gelu-fusion no-bias-swiglu-fusion no-bias-dropout-fusion no-rope-fusion
no-gradient-accumulation-fusion log-throughput log-params-norm log-num-zeros-in-grad
log-timers-to-tensorboard log-validation-ppl-to-tensorboard log-memory-to-tensorboard
log-progress tp-comm-overlap moe-grouped-gemm moe-permute-fusion mock-data
no-create-attention-mask-in-dataloader no-async-tensor-model-parallel-allreduce
no-load-optim no-load-rng no-save-optim no-save-rng exit-on-missing-checkpoint
use-checkpoint-args accumulate-allreduce-grads-in-fp32 attention-softmax-in-fp32
distribute-saved-activations use-torch-fsdp2 ddp-average-in-collective
align-grad-reduce align-param-gather defer-embedding-wgrad-compute""".split())
#: Megatron arguments with values that do not change what parbench computes (schedule, data,
#: logging, checkpoints, performance); their values are skipped up to the next ``--``
_MEGATRON_IGNORED_VALUED = frozenset("--" + n for n in """
lr-decay-style lr-warmup-iters lr-warmup-fraction lr-warmup-samples lr-decay-iters
lr-decay-samples lr-warmup-init min-lr train-iters train-samples data-path train-data-path
valid-data-path test-data-path split tokenizer-type tokenizer-model vocab-file merge-file
data-cache-path log-interval save load save-interval eval-interval eval-iters
tensorboard-dir tensorboard-queue-size wandb-project wandb-exp-name wandb-save-dir
attention-backend num-workers distributed-backend distributed-timeout-minutes
manual-gc-interval ckpt-format moe-token-dispatcher-type exit-duration-in-mins
exit-interval log-interval timing-log-level bucket-size ddp-bucket-size
moe-router-dtype optimizer""".split())
#: Megatron arguments that change the computation in ways parbench does not model
_MEGATRON_REFUSED = {
    "--decoder-first-pipeline-num-layers": "uneven pipeline stages are not modelled yet",
    "--decoder-last-pipeline-num-layers": "uneven pipeline stages are not modelled yet",
    "--account-for-embedding-in-pipeline-split": "uneven pipeline stages are not modelled yet",
    "--account-for-loss-in-pipeline-split": "uneven pipeline stages are not modelled yet",
    "--multi-latent-attention": "multi-latent attention is not modelled",
    "--apply-layernorm-1p": "the zero-centred (1 + gamma) norm is not modelled",
    "--qk-layernorm": "query/key norms are not modelled",
    "--fp16": "parbench runs fp32 or bf16 (no fp16 loss scaling)",
    "--fp8-format": "fp8 is not modelled", "--fp8-recipe": "fp8 is not modelled",
    "--moe-shared-expert-intermediate-size": "shared experts are not modelled",
    "--rampup-batch-size": "a batch size that changes during training is not modelled",
    "--recompute-method": "only whole-model recomputation (granularity) is modelled",
    "--recompute-num-layers": "only whole-model recomputation (granularity) is modelled",
}
#: Megatron arguments that must keep one value (the one parbench computes with): name -> value
_MEGATRON_FIXED = {"--rotary-percent": 1.0, "--attention-dropout": 0.0, "--hidden-dropout": 0.0}


def _refusal(key: str) -> str | None:
    """Why ``key`` is refused (None: it is not)."""
    if key in _MEGATRON_REFUSED:
        return _MEGATRON_REFUSED[key]
    if key.startswith("--fp8"):
        return "fp8 is not modelled"
    return None


def _megatron_type(key: str) -> Any:
    """The value type of a Megatron argument with one value (None: not such an argument)."""
    if key in _MEGATRON_ARGS:
        return _MEGATRON_ARGS[key][1]
    if key in _MEGATRON_DERIVED:
        return int
    if key in _MEGATRON_CHOICES:
        return str
    return _MEGATRON_CHECKED.get(key)


def _read_value(argv: list[str], i: int, key: str, inline: str) -> tuple[str, int]:
    """The one value of the argument at ``argv[i]`` and the index after it."""
    if inline:
        return inline, i + 1
    if i + 1 < len(argv):
        return argv[i + 1], i + 2
    raise ConfigError(f"Megatron argument {key!r} needs a value")


def _skip_values(argv: list[str], i: int, inline: str) -> int:
    """The index after an ignored argument's values (every token up to the next ``--``)."""
    i += 1
    if inline:
        return i
    while i < len(argv) and not argv[i].startswith("--"):
        i += 1
    return i


def read_megatron(argv: list[str]) -> tuple[dict[str, Any], list[str]]:
    """The Megatron arguments parbench reads (name -> value, ``True`` for a flag) and the
    names of those it ignores, in the order given; refused and unknown ones raise."""
    out: dict[str, Any] = {}
    ignored: list[str] = []
    i = 0
    while i < len(argv):
        key, _, inline = argv[i].partition("=")
        why = _refusal(key)
        if why:
            raise ConfigError(f"Megatron argument {key} is not supported: {why}")
        typ = _megatron_type(key)
        if key in _MEGATRON_FLAGS or key in _MEGATRON_CHECKED_FLAGS:
            out[key], i = True, i + 1
        elif key in _MEGATRON_IGNORED_FLAGS:
            ignored.append(key)
            i += 1
        elif key in _MEGATRON_IGNORED_VALUED:
            ignored.append(key)
            i = _skip_values(argv, i, inline)
        elif typ is not None:
            value, i = _read_value(argv, i, key, inline)
            out[key] = value if typ is str else coerce(value, typ, key)
        else:
            raise ConfigError(f"Megatron argument {key!r} is not supported (unknown to parbench)")
    return out, ignored


def megatron_values(argv: list[str]) -> dict[str, Any]:
    """Megatron argument -> its value (a number or choice; ``True`` for a flag), in the
    order given; ``--key value`` and ``--key=value`` both read; ignored ones left out."""
    return read_megatron(argv)[0]


def megatron_ignored(argv: list[str]) -> list[str]:
    """The Megatron arguments given that do not change what parbench computes."""
    return read_megatron(argv)[1]


def _choice_fields(args: dict[str, Any]) -> dict[str, Any]:
    """The fields the flags and the choice arguments set, in the order given."""
    vals: dict[str, Any] = {}
    for key, value in args.items():
        if key in _MEGATRON_FLAGS:
            vals.update(_MEGATRON_FLAGS[key])
        elif key in _MEGATRON_CHOICES:
            table = _MEGATRON_CHOICES[key]
            if value not in table:
                raise ConfigError(f"Megatron argument {key}={value} is not supported (parbench "
                                  f"reads {', '.join(table)})")
            vals.update(table[value])
    return vals


def _megatron_checks(args: dict[str, Any], vals: dict[str, Any]) -> None:
    """The arguments that must agree with the model parbench builds; GQA's query groups and
    RoPE's base into ``vals``."""
    for key, want in _MEGATRON_FIXED.items():
        if key in args and args[key] != want:
            raise ConfigError(f"Megatron argument {key}={args[key]} is not supported: parbench "
                              f"computes with {want}")
    if args.get("--group-query-attention") and "--num-query-groups" in args:
        vals["num_kv_heads"] = args["--num-query-groups"]
    if vals.get("rope_theta") and "--rotary-base" in args:
        vals["rope_theta"] = args["--rotary-base"]
    hidden, heads = vals.get("hidden_size"), vals.get("num_heads")
    kv = args.get("--kv-channels")
    if kv is not None and hidden and heads and kv * heads != hidden:
        raise ConfigError(f"Megatron argument --kv-channels={kv} is not supported: parbench "
                          f"ties head_dim to hidden_size/num_heads={hidden}/{heads}")
    max_pos, seq = args.get("--max-position-embeddings"), vals.get("seq_length")
    if max_pos is not None and seq is not None and max_pos < seq:
        raise ConfigError(f"--max-position-embeddings={max_pos} is below --seq-length={seq}")


def _case_fields(args: dict[str, Any]) -> dict[str, Any]:
    """The bare case fields Megatron arguments set (ffn 0 = 4h unless given; the embeddings
    tied unless untied, as Megatron ties them)."""
    vals = {_MEGATRON_ARGS[k][0]: v for k, v in args.items() if k in _MEGATRON_ARGS}
    vals.setdefault("tie_embeddings", True)
    vals.update(_choice_fields(args))
    _megatron_checks(args, vals)
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
    fields = _case_fields(args)
    fields["dp"] = _dp(fields, world_size)
    case = apply_overrides(CaseConfig(), fields)
    return replace(case, layout=_derived_layout(case, args, world_size))


def _dp(fields: dict[str, Any], world_size: int | None) -> int:
    """dp = world / (tp cp pp); without the world, the least dp that holds ep's experts
    (ep / gcd(ep, cp), expert tp = tp)."""
    tp, cp, pp = (fields.get(k, 1) for k in ("tp", "cp", "pp"))
    if world_size is None:
        ep = fields.get("ep", 1)
        return ep // math.gcd(ep, cp)
    if world_size % (tp * cp * pp):
        raise ConfigError(f"world_size={world_size} is not a multiple of tp*cp*pp={tp * cp * pp}")
    return world_size // (tp * cp * pp)


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


#: the option and run fields Megatron arguments may set (the others are model/layout fields)
_MEGATRON_OTHER_KEYS = {"sp": "tensor.sp", "recompute": "recompute", "clip_grad": "run.clip_grad",
                        "lr": "run.lr", "weight_decay": "run.weight_decay", "beta1": "run.beta1",
                        "beta2": "run.beta2", "eps": "run.eps", "seed": "run.seed",
                        "dtype": "run.dtype"}


def _text(v: Any) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def megatron_overrides(text: str) -> dict[str, str]:
    """``key=value`` overrides (model, layout, option and run fields) from a Megatron argument
    string: every field the arguments set or derive, and any other model or layout field
    that differs from a default case's."""
    argv = shlex.split(text)
    case = from_megatron_args(argv)
    args = megatron_values(argv)
    fields = _case_fields(args)
    given = set(fields) - {"ffn_hidden_size"} \
        | {_MEGATRON_DERIVED[k] for k in args if k in _MEGATRON_DERIVED}
    if "--ffn-hidden-size" in args:
        given.add("ffn_hidden_size")
    out: dict[str, str] = {}
    base = CaseConfig()
    for sec in ("model", "layout"):
        for f in dataclasses.fields(getattr(case, sec)):
            v = getattr(getattr(case, sec), f.name)
            if f.name in given or v != getattr(getattr(base, sec), f.name):
                out[f"{sec}.{f.name}"] = _text(v)
    for name, key in _MEGATRON_OTHER_KEYS.items():
        if name in fields:
            out[key] = _text(fields[name])
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
