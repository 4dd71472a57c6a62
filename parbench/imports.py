"""Importing Megatron-LM command-line arguments as a case.

Reachable from the command line: ``parbench estimate megatron_args="--num-layers 96
--hidden-size 12288 ..."``. The tables of what each argument does live in
:mod:`parbench.megatron_args`; DeepSpeed JSON configs in :mod:`parbench.import_deepspeed`.
"""
from __future__ import annotations

import dataclasses
import math
import shlex
from typing import Any

from dataclasses import replace

from .config import CaseConfig, ConfigError
from .layout import Layout
from .megatron_args import (
    MEGATRON_ARGS,
    MEGATRON_ATTENTION,
    MEGATRON_CHECKED,
    MEGATRON_CHECKED_FLAGS,
    MEGATRON_CHOICES,
    MEGATRON_DERIVED,
    MEGATRON_FIXED,
    MEGATRON_FLAGS,
    MEGATRON_IGNORED_FLAGS,
    MEGATRON_IGNORED_VALUED,
    MEGATRON_LIST_ARGS,
    MEGATRON_MOE_DEFAULTS,
    MEGATRON_NUMERICS_ONLY,
    MEGATRON_NUMERICS_ONLY_FLAGS,
    MEGATRON_REFUSED,
)
from .megatron_checks import fsdp_check, mla_check, moe_layer_freq, router_checks
from .overrides import apply_overrides, coerce

def _refusal(key: str) -> str | None:
    """Why ``key`` is refused (None: it is not)."""
    if key in MEGATRON_REFUSED:
        return MEGATRON_REFUSED[key]
    if key.startswith("--fp8"):
        return "fp8 is not modelled"
    return None


def _megatron_type(key: str) -> Any:
    """The value type of a Megatron argument with one value (None: not such an argument)."""
    if key in MEGATRON_ARGS:
        return MEGATRON_ARGS[key][1]
    if key in MEGATRON_DERIVED:
        return int
    if key in MEGATRON_CHOICES:
        return str
    return MEGATRON_CHECKED.get(key)


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
        if key in MEGATRON_FLAGS or key in MEGATRON_CHECKED_FLAGS:
            out[key], i = True, i + 1
        elif key in MEGATRON_IGNORED_FLAGS or key in MEGATRON_NUMERICS_ONLY_FLAGS:
            ignored.append(key)
            i += 1
        elif key in MEGATRON_IGNORED_VALUED or key in MEGATRON_NUMERICS_ONLY:
            ignored.append(key)
            i = _skip_values(argv, i, inline)
        elif key in MEGATRON_LIST_ARGS:
            end = _skip_values(argv, i, inline)
            out[key] = inline or ",".join(argv[i + 1:end])
            i = end
        elif typ is not None:
            value, i = _read_value(argv, i, key, inline)
            out[key] = value if typ is str else coerce(value, typ, key)
        else:
            raise ConfigError(f"Megatron argument {key!r} is not supported (unknown to parbench)")
    return out, ignored + _without_effect(out)


def _without_effect(args: dict[str, Any]) -> list[str]:
    """The arguments given that Megatron-Core reads but that change nothing beside the
    others, in the order given: the bias update rate without
    ``--moe-router-enable-expert-bias`` (megatron/core/transformer/moe/router.py keeps no
    bias then), the group count without ``--moe-router-group-topk`` (moe_utils.py's
    ``group_limited_topk`` runs only with it), ``--moe-router-pre-softmax`` with the sigmoid
    score (only the softmax branch of ``topk_routing_with_score_function`` reads it),
    Megatron-FSDP's sharding strategy and gradient dtypes without ``--use-megatron-fsdp``."""
    sigmoid = args.get("--moe-router-score-function") == "sigmoid"
    fsdp = bool(args.get("--use-megatron-fsdp"))
    idle = {"--data-parallel-sharding-strategy": not fsdp,
            "--megatron-fsdp-grad-comm-dtype": not fsdp,
            "--megatron-fsdp-main-grads-dtype": not fsdp,
            "--moe-router-bias-update-rate": not args.get("--moe-router-enable-expert-bias"),
            "--moe-router-num-groups": not args.get("--moe-router-group-topk"),
            "--moe-router-pre-softmax": sigmoid}
    return [k for k in args if idle.get(k)]


def megatron_values(argv: list[str]) -> dict[str, Any]:
    """Megatron argument -> its value (a number or choice; ``True`` for a flag), in the
    order given; ``--key value`` and ``--key=value`` both read; ignored ones left out."""
    return read_megatron(argv)[0]


def megatron_ignored(argv: list[str]) -> list[str]:
    """The Megatron arguments given that do not change what parbench computes."""
    return read_megatron(argv)[1]


def megatron_attention(argv: list[str]) -> str:
    """How the attention the arguments run is counted and priced (``flash`` or ``eager``):
    ``--attention-backend`` (:data:`MEGATRON_ATTENTION`), Megatron-Core's ``auto`` when
    absent."""
    return _attention(megatron_values(argv).get("--attention-backend", "auto"))


def _attention(backend: str) -> str:
    if backend not in MEGATRON_ATTENTION:
        raise ConfigError(f"Megatron argument --attention-backend={backend} is not supported "
                          f"(parbench reads {', '.join(MEGATRON_ATTENTION)})")
    return MEGATRON_ATTENTION[backend]


def _choice_fields(args: dict[str, Any]) -> dict[str, Any]:
    """The fields the flags and the choice arguments set, in the order given."""
    vals: dict[str, Any] = {}
    for key, value in args.items():
        if key in MEGATRON_FLAGS:
            vals.update(MEGATRON_FLAGS[key])
        elif key in MEGATRON_CHOICES:
            table = MEGATRON_CHOICES[key]
            if value not in table:
                raise ConfigError(f"Megatron argument {key}={value} is not supported (parbench "
                                  f"reads {', '.join(table)})")
            vals.update(table[value])
    return vals


def _megatron_checks(args: dict[str, Any], vals: dict[str, Any]) -> None:
    """The arguments that must agree with the model parbench builds; GQA's query groups and
    RoPE's base into ``vals``."""
    for key, want in MEGATRON_FIXED.items():
        if key in args and args[key] != want:
            raise ConfigError(f"Megatron argument {key}={args[key]} is not supported: parbench "
                              f"computes with {want}")
    if "--attention-backend" in args:
        _attention(args["--attention-backend"])
    if args.get("--group-query-attention") and "--num-query-groups" in args:
        vals["num_kv_heads"] = args["--num-query-groups"]
    if vals.get("rope_theta") and "--rotary-base" in args:
        vals["rope_theta"] = args["--rotary-base"]
    mla_check(args, vals)
    router_checks(args, vals)
    fsdp_check(args, vals)
    hidden, heads = vals.get("hidden_size"), vals.get("num_heads")
    kv = args.get("--kv-channels")
    if kv is not None and hidden and heads and kv * heads != hidden and \
            not args.get("--multi-latent-attention"):
        raise ConfigError(f"Megatron argument --kv-channels={kv} is not supported: parbench "
                          f"ties head_dim to hidden_size/num_heads={hidden}/{heads}")
    if "--moe-layer-freq" in args:
        vals.update(moe_layer_freq(args["--moe-layer-freq"], vals.get("num_layers")))
    max_pos, seq = args.get("--max-position-embeddings"), vals.get("seq_length")
    if max_pos is not None and seq is not None and max_pos < seq:
        raise ConfigError(f"--max-position-embeddings={max_pos} is below --seq-length={seq}")


def _case_fields(args: dict[str, Any]) -> dict[str, Any]:
    """The bare case fields Megatron arguments set (ffn 0 = 4h unless given; the embeddings
    tied unless untied, as Megatron ties them)."""
    vals = {MEGATRON_ARGS[k][0]: v for k, v in args.items() if k in MEGATRON_ARGS}
    vals.update({MEGATRON_LIST_ARGS[k]: v for k, v in args.items() if k in MEGATRON_LIST_ARGS})
    vals.setdefault("tie_embeddings", True)
    if vals.get("num_experts"):
        for name, value in MEGATRON_MOE_DEFAULTS.items():
            vals.setdefault(name, value)
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
    if per_vstage and lay.uneven:
        raise ConfigError(f"--num-layers-per-virtual-pipeline-stage={per_vstage} with uneven "
                          "pipeline stages: give --num-virtual-stages-per-pipeline-rank "
                          "(Megatron-LM's rule)")
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


#: the option and run fields Megatron arguments may set (the others are model/layout fields)
_MEGATRON_OTHER_KEYS = {"sp": "tensor.sp", "zero_stage": "data.zero_stage",
                        "recompute": "recompute",
                        "recompute_modules": "recompute_modules", "clip_grad": "run.clip_grad",
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
        | {MEGATRON_DERIVED[k] for k in args if k in MEGATRON_DERIVED}
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
