"""Each family's default case set: what ``parbench verify scheme=...`` runs when given no case
field, what ``assert_equivalent(scheme)`` runs when given none, and what ``cases(family)``
draws from -- one definition for the three (issue 20, section 2: seven of fifteen real bugs
rebuilt as user schemes passed the single small case that was the default before).

Every set covers, at small cost (tiny models, world <= 4):

- >= 2 micro-batches and >= 3 checked steps (gradient-accumulation bugs; bugs that show only
  once the optimizer states are warm);
- a shape that pads: an odd vocabulary (61, prime: no tp divides it, the vocab-parallel
  layers pad it) and, where no tp splits it, an odd hidden size (35, five heads of 7) and
  sequence (11), so that the flat buffer of all parameters is a multiple of no data case's
  dp (35035 elements untied: odd, and 1 mod 3; 32900 tied, run at dp = 3: 2 mod 3) and
  neither are most tensors in it (ZeRO's padded last shard); under tp the widths the
  layout rules allow that split oddly (head_dim 9, ffn 100 -> 50 per rank, SP's s/tp = 7);
- an odd data-parallel degree (dp = 3 on 3 ranks) where the family has data parallelism;
- tied embeddings, and pp x dp with tied embeddings (Megatron's embedding group);
- the training features the scheme declares (gradient clipping, a masked loss, packed
  documents: one case with all of them) and, where it runs them, the LLaMA-3 blocks
  (``llama-tiny``: RoPE, GQA, SwiGLU, RMSNorm, no biases) -- ``feature_cases``;
- every option the scheme declares (``Scheme.options``), in each of its values: the choices
  of an option field of ``parbench.options`` (``sp`` off and on, ``cp_balance`` none /
  zigzag / striped, ``recompute`` none / selective / full, ``zero_stage`` 0-3, ...) and, for
  a few numeric fields, a second value that changes what a scheme does (:data:`EXTRA`).
  Each value is placed on a case where it takes effect (``sp`` where tp > 1, ``cp_*`` where
  cp > 1, ...) -- each value once, not the cross product -- adding a case only when every
  such case already carries another value of that option.

The cases a scheme's ``check`` (or the layout rules) rejects are left out, and the callers say
which and why; an option value rejected where it was placed is dropped from that case (which
runs with the values its scheme accepts), and a case added only to carry values is dropped
when it keeps none.
"""
from __future__ import annotations

import math
from dataclasses import fields
from typing import Any

#: the native scheme each family's users compare with (``parbench verify``, ``cases``)
NATIVE = {"data": "data.ddp", "pipeline": "pipeline.1f1b", "tensor": "tensor.megatron",
          "context": "context.ring-attention", "expert": "expert.alltoall",
          "hybrid": "hybrid"}
#: further native schemes of a family, for the cases its first one rejects (``sp=true``)
ALTERNATES = {"tensor": ("tensor.megatron-sp",)}

#: shapes no degree of the family's cases divides evenly (see the module docstring)
ODD = {"vocab_size": 61, "hidden_size": 35, "num_heads": 5, "seq_length": 11}
#: the same under tensor parallelism: tp = 2 must divide the heads and the MLP, and (SP) the
#: sequence; cp = 2 with zig-zag needs 2 cp | s
ODD_TP = {"vocab_size": 61, "hidden_size": 36, "num_heads": 4, "ffn_hidden_size": 100,
          "seq_length": 14}
ODD_CP = {"vocab_size": 61, "hidden_size": 36, "num_heads": 4, "ffn_hidden_size": 100,
          "seq_length": 20}

#: what every default case runs: 3 checked steps; one timed step (a continuous pipeline
#: drains in it; section 1 of issue 20 verifies it too). The first case of a set also times
#: 3 steps beside the native scheme (``parbench verify``'s time ratio).
COMMON = {"steps": 3, "timed_steps": 1, "micro_batch_size": 1}
FIRST_TIMED_STEPS = 3

#: per family, the structural cases (fields as ``parbench run`` takes them)
BASES: dict[str, list[dict[str, Any]]] = {
    "data": [
        {"model": "tiny", **ODD, "dp": 2, "num_microbatches": 2},
        {"model": "tiny", **ODD, "dp": 3, "num_microbatches": 3},
        {"model": "tiny", **ODD, "dp": 3, "num_microbatches": 2, "tie_embeddings": True},
    ],
    "pipeline": [
        {"model": "tiny-4l", **ODD, "pp": 2, "num_microbatches": 3},
        {"model": "tiny-4l", **ODD, "pp": 2, "num_microbatches": 4, "tie_embeddings": True},
        {"model": "tiny-4l", **ODD, "pp": 2, "dp": 2, "num_microbatches": 2,
         "tie_embeddings": True},
    ],
    "tensor": [
        {"model": "tiny", **ODD_TP, "tp": 2, "num_microbatches": 2},
        {"model": "tiny", **ODD_TP, "tp": 2, "num_microbatches": 3, "tie_embeddings": True},
    ],
    "context": [
        {"model": "tiny", **ODD_CP, "cp": 2, "num_microbatches": 2},
        {"model": "tiny", **ODD_CP, "cp": 2, "num_microbatches": 2, "tie_embeddings": True},
    ],
    "expert": [
        {"model": "tiny", **ODD, "dp": 2, "ep": 2, "num_experts": 4, "num_microbatches": 2},
        {"model": "tiny", **ODD, "dp": 3, "ep": 3, "num_experts": 3, "moe_top_k": 2,
         "num_microbatches": 2},
    ],
    "hybrid": [
        {"model": "tiny-4l", **ODD_CP, "tp": 2, "pp": 2, "num_microbatches": 2},
        {"model": "tiny-4l", **ODD_CP, "cp": 2, "dp": 2, "num_microbatches": 2},
        {"model": "tiny-4l", **ODD_CP, "dp": 2, "pp": 2, "num_microbatches": 4},
        {"model": "tiny-4l", **ODD_CP, "dp": 2, "pp": 2, "num_microbatches": 2,
         "tie_embeddings": True},
        {"model": "tiny", **ODD_CP, "tp": 2, "dp": 2, "ep": 2, "etp": 1, "num_experts": 4,
         "num_microbatches": 2},
    ],
}

#: the training features a scheme declares (``Scheme.supports_*``; issue 20, sec. 3) and the
#: value its feature case sets: a clip below the tiny models' gradient norm (about 1), so
#: every step clips; prompts of up to 60% of a sample masked; 1-3 documents per sample
FEATURES = (("supports_clip_grad", "clip_grad", 0.5), ("supports_loss_mask", "loss_mask", 0.6),
            ("supports_packing", "pack_docs", 3))
#: the LLaMA-3 blocks' case (issue 21): ``llama-tiny`` with the odd vocabulary (RoPE needs
#: an even head_dim, so the odd hidden size stays with the other cases)
LLAMA = {"model": "llama-tiny", "vocab_size": ODD["vocab_size"]}


def feature_cases(scheme_cls, family: str) -> list[dict]:
    """Up to two cases beside the structural ones, on the family's first: every training
    feature the scheme declares at once (``FEATURES``), and the LLaMA-3 blocks when it runs
    all of them (``Scheme.model_features``)."""
    from ..config import MODEL_FEATURES
    first = {**base_fields(family)[0], "timed_steps": COMMON["timed_steps"]}
    out = []
    on = {name: value for attr, name, value in FEATURES if getattr(scheme_cls, attr, False)}
    if on:
        out.append({**first, **on})
    if MODEL_FEATURES <= frozenset(getattr(scheme_cls, "model_features", ())):
        plain = {k: v for k, v in first.items() if k not in ODD and k != "model"}
        out.append({**plain, **LLAMA})
    return out


#: numeric fields a scheme may declare, and the values beside the default that change what
#: it does (the choices of the other option fields are in their metadata)
EXTRA: dict[str, tuple] = {
    "bucket_mb": (0.01,),          # several gradient buckets instead of one
    "seq_segments": (2,),          # token slices of uneven length (13 = 7 + 6)
    "vpp": (2,),                   # two model chunks per rank
    "cp_ulysses": (2,),            # USP: the Ulysses part of the cp grid
    "moe_shadow": (1,),            # FasterMoE: one shadowed expert
    "moe_top_k": (2,),
    "moe_capacity_factor": (0.0,),  # no capacity limit
    "local_sgd_period": (1,),      # average every step
}


def _option_field(name: str):
    """(the option dataclass field of ``name``, its family) or (None, None)."""
    from ..options import FAMILY_OPTIONS, Options
    for fam, kind in FAMILY_OPTIONS.items():
        for f in fields(kind):
            if f.name == name:
                return f, fam
    if name == "recompute":
        return next(f for f in fields(Options) if f.name == name), None
    return None, None


def _default_of(name: str):
    from ..config import CaseConfig
    from ..overrides import resolve_key
    info = resolve_key(name)
    section = getattr(CaseConfig(), info.section, None)
    if section is None:  # an option: its family's dataclass
        f, _ = _option_field(name)
        return f.default
    return getattr(section, info.name)


def option_values(name: str) -> tuple:
    """Every value of option ``name`` a default set covers, the default first: the field's
    ``choices``, both booleans, or the default and :data:`EXTRA`'s values; () when the
    option is not varied."""
    f, _ = _option_field(name)
    if f is not None and "choices" in f.metadata:
        rest = tuple(v for v in f.metadata["choices"] if v != f.default)
        return (f.default,) + rest
    if f is not None and isinstance(f.default, bool):
        return (f.default, not f.default)
    if name in EXTRA:
        return (_default_of(name),) + EXTRA[name]
    return ()


def takes_effect(name: str, fields_: dict) -> bool:
    """Whether option ``name`` changes anything on a case with these fields: tensor
    options where tp > 1, context options where cp > 1, pipeline options and vpp where
    pp > 1, data options where dp > 1, MoE fields on MoE models; recompute everywhere."""
    _, fam = _option_field(name)
    axis = {"tensor": "tp", "context": "cp", "pipeline": "pp", "data": "dp"}.get(
        "pipeline" if name == "vpp" else fam)
    if axis is not None:
        return int(fields_.get(axis, 1)) > 1
    if fam == "expert" or name.startswith("moe_"):
        return int(fields_.get("num_experts", 0)) > 0
    return True


def _place(cases: list[dict], name: str, values: tuple) -> None:
    """Put each value of ``name`` on its own case where it takes effect: the j-th such case
    takes the j-th value; past them, a copy of one of them (round robin) is added."""
    where = [i for i, c in enumerate(cases) if takes_effect(name, c["fields"])]
    for j, value in enumerate(values if where else ()):
        if j < len(where):
            cases[where[j]]["placed"][name] = value
        else:
            src = cases[where[j % len(where)]]
            fields_ = {**src["fields"], "timed_steps": COMMON["timed_steps"]}  # one timed case
            cases.append({"fields": fields_, "placed": {**src["placed"], name: value},
                          "copy": True})


def place_options(bases: list[dict], options: tuple[str, ...]) -> list[dict]:
    """The cases of a default set: ``bases`` (field dicts) with every value of each declared
    option placed (``_place``; options with the most values first). Each case is
    ``{"fields", "placed", "copy"}``: its base, the option values put on it, and whether it
    was added to carry a value."""
    cases = [{"fields": b, "placed": {}, "copy": False} for b in bases]
    varied = [(n, option_values(n)) for n in options]
    for name, values in sorted(varied, key=lambda nv: -len(nv[1])):
        if len(values) > 1:
            _place(cases, name, values)
    return cases


def base_fields(family: str) -> list[dict]:
    """The family's structural cases with the common fields (the first times 3 steps)."""
    if family not in BASES:
        raise KeyError(family)
    out = [{**COMMON, **b} for b in BASES[family]]
    out[0]["timed_steps"] = FIRST_TIMED_STEPS
    return out


def as_override(value: Any) -> str:
    """A typed field value as ``parbench run`` writes it (``true``, ``0.01``, ``inf``)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return str(value)


def default_cases(scheme_cls, spec: str, family: str | None = None
                  ) -> tuple[list, list[str]]:
    """(the validated cases of the default set of ``family`` (default: the scheme's), run by
    ``spec``; why others were left out). The bases the scheme rejects are left out first;
    the option values are placed on the others; a value rejected where it was placed is
    dropped from that case (a case added only to carry values is dropped when none is
    accepted)."""
    from ..config import ConfigError
    fam = family or scheme_cls.family
    if fam not in BASES:
        raise ConfigError(f"family={fam!r} of scheme {spec} has no default case set "
                          f"(families: {', '.join(BASES)}); give suite=NAME or the case's "
                          "fields")
    skipped: list[str] = []
    bases = []
    own = dict(getattr(scheme_cls, "default_fields", {}))  # the scheme's degrees and shape
    for fields_ in base_fields(fam) + feature_cases(scheme_cls, fam):
        fields_ = {**fields_, **own}
        why = _rejection(scheme_cls, spec, fields_)
        if why:
            skipped.append(f"{_describe(fields_, {})}: {why}")
        else:
            bases.append(fields_)
    out, seen = [], set()
    for case in place_options(bases, tuple(scheme_cls.options)):
        built = _with_accepted(scheme_cls, spec, case, skipped)
        if built is not None and built.id not in seen:
            seen.add(built.id)
            out.append(built)
    return out, skipped


def _rejection(scheme_cls, spec: str, fields_: dict) -> str | None:
    from ..config import ConfigError
    try:
        _build(scheme_cls, spec, fields_)
    except ConfigError as e:
        return str(e)
    return None


def _with_accepted(scheme_cls, spec: str, case: dict, skipped: list[str]):
    """The case with every placed value its scheme accepts (greedily, in placing order),
    the others recorded in ``skipped``; None for a carrying copy that keeps no value."""
    from ..config import ConfigError
    base, kept = case["fields"], {}
    try:
        return _build(scheme_cls, spec, {**base, **case["placed"]})
    except ConfigError:
        pass
    for name, value in case["placed"].items():
        why = _rejection(scheme_cls, spec, {**base, **kept, name: value})
        if why:
            skipped.append(f"{_describe(base, {name: value})}: {why}")
        else:
            kept[name] = value
    if case["copy"] and not kept:
        return None
    return _build(scheme_cls, spec, {**base, **kept})


def _build(scheme_cls, spec: str, fields_: dict):
    """The case of ``fields_`` run by ``spec``: validated, then held to the scheme's check."""
    from ..config import CaseConfig, validate_case
    from ..overrides import apply_overrides
    from ..suites import case_id
    case = apply_overrides(CaseConfig(), {**{k: as_override(v) for k, v in fields_.items()},
                                          "scheme": spec})
    validate_case(case)
    scheme_cls.check(case)
    case.id = case_id(case)
    return case


def _describe(fields_: dict, placed: dict) -> str:
    keys = ("tp", "cp", "ep", "dp", "pp", "num_microbatches", "tie_embeddings")
    shown = {k: fields_[k] for k in keys if k in fields_}
    shown.update(placed)
    return " ".join(f"{k}={as_override(v)}" for k, v in shown.items())
