"""Configuration: model, parallel and run settings as dataclasses, presets, and validation.

Every numeric field carries its rule in the field's metadata (``>= 1``, ``> 0``, ``>= 0``,
``in [0, 1)``, ...); ``validate_case`` checks them all and the cross-field rules (divisibility,
the mesh) before any rank is spawned, with a message that names the field, the value and the
rule. ``key=value`` overrides are coerced in ``parbench.overrides``; Megatron arguments and
DeepSpeed JSON are imported in ``parbench.imports``.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, fields, replace
from typing import Any

from .layout import ConfigError, Layout
from .moe_rules import DEEPSEEK_MOE_FIELDS, moe_features, validate_moe
from .options import Options
from .presets import PRESETS
from .tolerance_rules import validate_tolerances

__all__ = ["ConfigError", "Layout", "Options", "ModelConfig", "RunConfig", "CaseConfig"]


#: the LLaMA-style model features (``ModelConfig.features``) a scheme may declare it runs
MODEL_FEATURES = frozenset({"rope", "gqa", "swiglu", "rmsnorm", "no-bias"})


def _rule(default, rule: str, help: str = ""):
    """A dataclass field with its validation rule (see ``RULES``)."""
    return field(default=default, metadata={"rule": rule, "help": help})


#: rule name -> (predicate, text of the rule in messages)
RULES: dict[str, tuple[Any, str]] = {
    "pos": (lambda v: v >= 1, "must be >= 1"),
    "nonneg": (lambda v: v >= 0, "must be >= 0"),
    "gt0": (lambda v: v > 0, "must be > 0"),
    "unit": (lambda v: 0 <= v < 1, "must be in [0, 1)"),
    "step": (lambda v: v >= -1, "must be >= -1 (-1: never)"),
    "seed": (lambda v: 0 <= v < 2**31, "must be in [0, 2^31)"),
}

#: fields outside the option dataclasses that only some schemes read: an override of one
#: that no case of a suite reads is an error, as for every option (``Scheme.options``)
OPTIONAL_FIELDS = ("num_experts", "moe_top_k", "moe_every", "moe_capacity_factor",
                   "moe_aux_loss_coef", "moe_z_loss_coef", "moe_router_skew", "etp", "vpp",
                   "schedule", *DEEPSEEK_MOE_FIELDS)


# --------------------------------------------------------------------------------------
# dataclasses
# --------------------------------------------------------------------------------------


@dataclass
class ModelConfig:
    """Shape of the reference GPT decoder (pre-LN, learned positions, 4h MLP by default).

    ``seq_length`` is the whole sequence of one sample; context parallelism splits it over
    the cp ranks (seq_length / cp tokens each).

    GPT-2 style by default. The LLaMA-style fields (``features``) and the DeepSeek-style MoE
    fields (``moe_features``, ``parbench.moe_rules``) run in the reference model and in the
    schemes that declare them (``Scheme.model_features``, ``Scheme.moe_features``), as do
    multi-head latent attention's fields (feature ``mla``, ``parbench.model.mla``); the
    vocabulary padding is analytic only (``ANALYTIC_ONLY_FIELDS``).
    """

    name: str = "custom"
    vocab_size: int = _rule(128, "pos")
    hidden_size: int = _rule(32, "pos")
    num_layers: int = _rule(2, "pos")
    num_heads: int = _rule(4, "pos")
    ffn_hidden_size: int = _rule(0, "nonneg", "0 means 4 * hidden_size")
    seq_length: int = _rule(16, "pos")
    tie_embeddings: bool = False
    position_embeddings: bool = True
    num_experts: int = _rule(0, "nonneg", "0 = dense")
    moe_top_k: int = _rule(1, "pos")
    #: layer i is an MoE layer iff num_experts > 0 and i % moe_every == 0 (Megatron-Core's
    #: moe_layer_freq); see parbench.model.moe for the routing, capacity and loss semantics
    moe_every: int = _rule(1, "pos")
    moe_capacity_factor: float = _rule(1.0, "nonneg", "0 = no capacity limit (no dropping)")
    moe_aux_loss_coef: float = _rule(0.01, "nonneg", "load-balancing loss (Switch Eq. 4)")
    moe_z_loss_coef: float = _rule(0.0, "nonneg", "router z-loss (ST-MoE Eq. 5)")
    #: a fixed bias on the router logits that makes low-numbered experts popular (a skewed
    #: router for FasterMoE's shadow experts; parbench.model.moe); 0 = none
    moe_router_skew: float = _rule(0.0, "nonneg", "0 = unskewed router")
    init_std: float = _rule(0.02, "gt0")
    #: packed sequences (parbench.model.packing): each sample holds 1..pack_docs documents
    #: ended by an EOD token (the last vocabulary id); attention stays within a document and
    #: positions restart after each EOD (Megatron-LM's --reset-attention-mask
    #: --reset-position-ids); 0 = one sequence per sample
    pack_docs: int = _rule(0, "nonneg", "most documents packed into a sample; 0 = unpacked")
    #: grouped-query attention's K/V heads, 0 = num_heads
    num_kv_heads: int = _rule(0, "nonneg", "0 = num_heads")
    #: gelu (two matrices) | swiglu (three: gate, up, down; fc1 holds [gate; up])
    mlp: str = "gelu"
    #: layernorm (weight and bias) | rmsnorm (weight)
    norm: str = "layernorm"
    #: biases on the linear layers (and LayerNorm's)
    bias: bool = True
    #: rotary position embedding's base (RoPE, Su et al. 2021; LLaMA-3: 500000), on the query
    #: and key heads at each token's position (within its document when packed); 0 = none
    rope_theta: float = _rule(0.0, "nonneg", "RoPE base; 0 = no rotary embedding")
    #: analytic only: pad the vocabulary to a multiple of this x tp (Megatron-LM's
    #: --make-vocab-size-divisible-by); 1 = a multiple of tp, what the reference model does
    make_vocab_size_divisible_by: int = _rule(1, "pos", "x tp (analytic only)")
    #: DeepSeek-style MoE (parbench.moe_rules, parbench.model.router): fine-grained and
    #: shared experts, first layers dense, the sigmoid router, the balancing bias, groups
    moe_ffn_hidden_size: int = _rule(0, "nonneg", "routed expert's hidden; 0 = ffn")
    moe_shared_expert_size: int = _rule(0, "nonneg", "shared expert's hidden; 0 = none")
    moe_first_dense: int = _rule(0, "nonneg", "first layers dense")
    moe_router: str = "softmax"  # softmax | sigmoid (DeepSeek-V3 Eq. 15-16)
    moe_bias_update_rate: float = _rule(0.0, "nonneg", "expert bias's gamma; 0 = no bias")
    moe_router_groups: int = _rule(0, "nonneg", "expert groups; 0 = not group-limited")
    moe_router_topk_groups: int = _rule(0, "nonneg", "groups kept per token")
    moe_router_scaling: float = _rule(1.0, "gt0", "routed gates' factor (DeepSeek-V3: 2.5)")
    #: multi-head latent attention (DeepSeek-V2 / V3; Megatron's --kv-lora-rank
    #: --q-lora-rank --qk-head-dim --qk-pos-emb-head-dim --v-head-dim): kv_lora_rank > 0
    #: (parbench.model.mla; bias=false; rope_theta rotates the qk_rope_head_dim parts)
    kv_lora_rank: int = _rule(0, "nonneg", "MLA's K/V latent; 0 = no MLA")
    q_lora_rank: int = _rule(0, "nonneg", "MLA's query latent; 0 = none")
    qk_head_dim: int = _rule(0, "nonneg", "MLA's query/key head dim; 0 = head_dim")
    qk_rope_head_dim: int = _rule(0, "nonneg", "MLA's rotary query/key part")
    v_head_dim: int = _rule(0, "nonneg", "MLA's value head dim; 0 = head_dim")
    #: multi-token prediction depths (DeepSeek-V3 Sec. 2.2; Megatron's --mtp-num-layers),
    #: analytic only (parbench.analytic.mtp)
    mtp_layers: int = _rule(0, "nonneg", "MTP modules (analytic only)")

    @property
    def ffn(self) -> int:
        """The MLP's hidden size: ``ffn_hidden_size``, or 4 * hidden_size when it is 0."""
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def features(self) -> dict[str, str]:
        """The LLaMA-style features this model uses, each with the field that turns it on
        (``Scheme.model_features`` says which a scheme runs)."""
        on = {"rope": (self.rope_theta, f"rope_theta={self.rope_theta:g}"),
              "gqa": (self.num_kv_heads not in (0, self.num_heads),
                      f"num_kv_heads={self.num_kv_heads}"),
              "swiglu": (self.mlp == "swiglu", "mlp=swiglu"),
              "rmsnorm": (self.norm == "rmsnorm", "norm=rmsnorm"),
              "no-bias": (not self.bias, "bias=false"),
              "mla": (self.kv_lora_rank > 0, f"kv_lora_rank={self.kv_lora_rank}")}
        return {name: field for name, (used, field) in on.items() if used}

    def moe_features(self) -> dict[str, str]:
        """The DeepSeek-style MoE features this model uses (``moe_rules.moe_features``)."""
        return moe_features(self)


@dataclass
class RunConfig:
    """What to run and how: scheme, steps, optimizer, device, tolerances.

    Tolerances (fp32). Losses and gradients: rtol 1e-5, atol 1e-6 -- reduction order is the
    only difference. Parameters after AdamW: atol 1e-4 (a tenth of one step at the default
    lr 1e-3): AdamW's update lr*m/(sqrt(v)+eps) turns a reduction-order difference d in a
    gradient near eps into an update difference of up to lr*d/eps, i.e. a fraction of lr
    (seen: 1.7e-5 for DDP on 3 ranks against the golden run). Gradients of step 0 (identical
    weights) use atol; gradients of later steps are computed on weights that already differ
    by up to param_atol and use param_atol. Every comparison is tensor-wise:
    max|ours - golden| <= atol + rtol * max|golden|.
    """

    scheme: str = "data.ddp"
    steps: int = _rule(3, "pos")
    warmup_steps: int = _rule(1, "nonneg", "timed steps discarded before medians")
    timed_steps: int = _rule(3, "nonneg", "steps after the checked ones, only timed")
    seed: int = _rule(1234, "seed")
    optimizer: str = "adamw"
    lr: float = _rule(1e-3, "gt0")
    weight_decay: float = _rule(0.01, "nonneg")
    beta1: float = _rule(0.9, "unit")
    beta2: float = _rule(0.95, "unit")
    eps: float = _rule(1e-8, "gt0")
    #: gradient clipping by global norm (Megatron-LM's ``--clip-grad``; Pascanu et al. 2013,
    #: Alg. 1): before each optimizer step every gradient is scaled by
    #: min(1, clip_grad / (||g||_2 + 1e-6)), ||g|| over the whole model (parbench.model.
    #: training.clip_coefficient); 0 = off
    clip_grad: float = _rule(0.0, "nonneg", "max global gradient norm; 0 = off")
    #: a loss mask (issue 20, sec. 3): each sample's first k targets are prompt tokens left
    #: out of the loss (ignore_index -100), k drawn per sample and step in [0, loss_mask * s];
    #: the loss is the mean over the global batch's unmasked tokens, whatever their share of
    #: each rank and micro-batch (Megatron-LM's --calculate-per-token-loss;
    #: parbench.model.data.mask_prompts); 0 = every token counts
    loss_mask: float = _rule(0.0, "unit", "largest masked prompt share of a sample; 0 = off")
    dtype: str = "fp32"  # fp32 | bf16 (compute dtype; master weights fp32)
    device: str = "cpu"  # cpu | cuda
    threads_per_rank: int = _rule(1, "pos")
    timeout_s: float = _rule(120.0, "gt0", "collective timeout")
    hang_timeout_s: float = _rule(60.0, "gt0", "a rank without progress this long is hung")
    rtol: float = _rule(1e-5, "nonneg")
    atol: float = _rule(1e-6, "nonneg")
    param_atol: float = _rule(1e-4, "nonneg")
    #: the traffic ledger and the timeline record every step (false: off, for measuring
    #: their overhead; a row then has no bytes)
    instrument: bool = True
    #: the instruments' cost measured inside one run (issue 24): the timed steps alternate,
    #: the first with the ledger and timeline, the next without, ... -- the same ranks, cores
    #: and placement on both sides; a step without them has no ledger (the timed-ledger
    #: check skips it)
    instrument_ab: bool = False
    #: the verdict's reference work (golden run, stepwise reference, final continuation)
    #: computed once on rank 0 and sent to every rank (false: on every rank, as before issue
    #: 24 -- what ``scripts/bench_verdict.py`` compares it with)
    shared_reference: bool = True
    fail_at_step: int = _rule(-1, "step", "testing aid: rank fail_rank fails at this step")
    fail_rank: int = _rule(0, "nonneg")
    fail_kind: str = "raise"  # testing aid: raise | hang (sleep inside the step)


@dataclass
class CaseConfig:
    """One case of a suite: the model, the parallel layout, the families' options, the run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    layout: Layout = field(default_factory=Layout)
    options: Options = field(default_factory=Options)
    run: RunConfig = field(default_factory=RunConfig)
    id: str = ""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "CaseConfig":
        """From ``to_dict`` output; a case written before the layout record (one
        ``parallel`` section) is read too."""
        if "parallel" in d and "layout" not in d:
            return _from_parallel_section(d)
        return cls(model=ModelConfig(**d.get("model", {})), layout=Layout(**d.get("layout", {})),
                   options=Options.from_dict(d.get("options")),
                   run=RunConfig(**d.get("run", {})), id=d.get("id", ""))


def _from_parallel_section(d: dict) -> CaseConfig:
    """A case dict of an older results file: its ``parallel`` section split into the layout
    and the options (``cp_kind`` was the name of ``cp_algorithm``)."""
    layout_names = {f.name for f in fields(Layout)}
    par = dict(d["parallel"])
    if "cp_kind" in par:
        par["cp_algorithm"] = par.pop("cp_kind")
    lay = {k: v for k, v in par.items() if k in layout_names}
    opts = Options().with_values(**{k: v for k, v in par.items() if k not in layout_names})
    return CaseConfig(model=ModelConfig(**d.get("model", {})), layout=Layout(**lay),
                      options=opts, run=RunConfig(**d.get("run", {})), id=d.get("id", ""))


def with_changes(case: CaseConfig, **sections: dict) -> CaseConfig:
    """Copy of ``case`` with field changes by section: ``with_changes(c, run={'steps': 2},
    layout={'tp': 2}, options={'sp': True})`` (options by bare name)."""
    return CaseConfig(
        model=replace(case.model, **sections.get("model", {})),
        layout=replace(case.layout, **sections.get("layout", {})),
        options=case.options.with_values(**sections.get("options", {})),
        run=replace(case.run, **sections.get("run", {})),
        id=case.id,
    )


# --------------------------------------------------------------------------------------
# presets
# --------------------------------------------------------------------------------------

LOCAL_PRESETS = ("tiny", "tiny-4l", "tiny-8l", "small", "bench", "llama-tiny", "deepseek-tiny",
                 "deepseek-v3-tiny")


def model_preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError(f"model={name!r} is not a preset (choose from {', '.join(PRESETS)})")
    return ModelConfig(name=name, **PRESETS[name])


# --------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------


def validate_fields(obj) -> None:
    """Every field's own rule (finite, and the rule in its metadata)."""
    for f in fields(obj):
        v = getattr(obj, f.name)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if isinstance(v, float) and not math.isfinite(v):
            raise ConfigError(f"{f.name}={v} must be a finite number")
        rule = f.metadata.get("rule")
        if rule and not RULES[rule][0](v):
            raise ConfigError(f"{f.name}={v} {RULES[rule][1]}")


def validate_model(m: ModelConfig) -> None:
    validate_fields(m)
    if m.hidden_size % m.num_heads:
        raise ConfigError(f"num_heads={m.num_heads} does not divide hidden_size={m.hidden_size}")
    if m.num_experts and m.moe_top_k > m.num_experts:
        raise ConfigError(f"moe_top_k={m.moe_top_k} exceeds num_experts={m.num_experts}")
    if m.num_kv_heads and m.num_heads % m.num_kv_heads:
        raise ConfigError(f"num_kv_heads={m.num_kv_heads} does not divide "
                          f"num_heads={m.num_heads}")
    if m.mlp not in ("gelu", "swiglu"):
        raise ConfigError(f"mlp={m.mlp!r} must be gelu or swiglu")
    if m.norm not in ("layernorm", "rmsnorm"):
        raise ConfigError(f"norm={m.norm!r} must be layernorm or rmsnorm")
    if m.pack_docs >= m.seq_length:
        raise ConfigError(f"pack_docs={m.pack_docs} must be < seq_length={m.seq_length}: "
                          "each document holds at least one token before its EOD")
    validate_moe(m)


#: analytic-only model fields (the estimate reads them, the reference model does not): a
#: runnable case must leave them at their default; and what the reference model does instead
ANALYTIC_ONLY_FIELDS = {
    "make_vocab_size_divisible_by": (1, "does not pad its vocabulary"),
    "mtp_layers": (0, "has no multi-token prediction modules"),
}


def validate_runnable_model(m: ModelConfig) -> None:
    """Reject the analytic-only fields at non-default values (the reference model would
    silently ignore them) and the feature combinations it does not run."""
    for name, (default, instead) in ANALYTIC_ONLY_FIELDS.items():
        v = getattr(m, name)
        if v != default:
            raise ConfigError(f"{name}={v} is analytic only: the reference model {instead} "
                              f"(use {name}={default}, or parbench estimate)")
    validate_mla(m)
    if m.rope_theta and m.head_dim % 2 and not m.kv_lora_rank:
        raise ConfigError(f"rope_theta={m.rope_theta:g} needs an even head_dim (hidden_size / "
                          f"num_heads = {m.head_dim}): RoPE rotates pairs of dimensions")


def validate_mla(m: ModelConfig) -> None:
    """Multi-head latent attention's rules (``parbench.model.mla``): its fields only with
    kv_lora_rank > 0, no biases, RoPE on the decoupled parts only and with a base."""
    mla_fields = ("q_lora_rank", "qk_head_dim", "qk_rope_head_dim", "v_head_dim")
    if not m.kv_lora_rank:
        for name in mla_fields:
            if getattr(m, name):
                raise ConfigError(f"{name}={getattr(m, name)} is multi-head latent "
                                  "attention's: it needs kv_lora_rank > 0")
        return
    if m.bias:
        raise ConfigError(f"kv_lora_rank={m.kv_lora_rank} with bias=true: multi-head latent "
                          "attention's linears have no biases (set bias=false)")
    if m.qk_rope_head_dim and (not m.rope_theta or m.qk_rope_head_dim % 2):
        raise ConfigError(f"qk_rope_head_dim={m.qk_rope_head_dim} needs rope_theta > 0 "
                          f"(is {m.rope_theta:g}) and an even width: RoPE rotates pairs")
    if m.rope_theta and not m.qk_rope_head_dim:
        raise ConfigError(f"rope_theta={m.rope_theta:g} with kv_lora_rank={m.kv_lora_rank}: "
                          "MLA rotates only its decoupled parts (set qk_rope_head_dim > 0)")


def validate_layout(c: "CaseConfig") -> None:
    """The layout's rules against the model (``Layout.check_model``) and the options that
    depend on the degrees. The zig-zag split's 2 cp rule is the ring schemes' own check:
    only they read ``cp_balance``."""
    lay, o = c.layout, c.options
    lay.check_model(c.model, sp=o.tensor.sp)
    if o.context.cp_ulysses > 1 and lay.cp % o.context.cp_ulysses:
        raise ConfigError(f"cp_ulysses={o.context.cp_ulysses} does not divide cp={lay.cp}")


def validate_run(r: RunConfig) -> None:
    validate_fields(r)
    if r.optimizer not in ("adamw", "sgd"):
        raise ConfigError(f"optimizer={r.optimizer!r} must be adamw or sgd")
    if r.dtype not in ("fp32", "bf16"):
        raise ConfigError(f"dtype={r.dtype!r} must be fp32 or bf16")
    if r.device not in ("cpu", "cuda"):
        raise ConfigError(f"device={r.device!r} must be cpu or cuda")
    if r.instrument_ab and not (r.instrument and r.timed_steps >= r.warmup_steps + 2):
        raise ConfigError(f"instrument_ab=true needs instrument=true and timed_steps >= "
                          f"warmup_steps + 2 (got instrument={r.instrument}, timed_steps="
                          f"{r.timed_steps}, warmup_steps={r.warmup_steps}): it alternates "
                          "timed steps with and without the instruments")
    if r.fail_kind not in ("raise", "hang"):
        raise ConfigError(f"fail_kind={r.fail_kind!r} must be raise or hang")
    validate_tolerances(r)


def validate_case(c: CaseConfig, world_size: int | None = None) -> None:
    """Check a case before anything is spawned; ``world_size`` is checked if given."""
    validate_model(c.model)
    validate_runnable_model(c.model)
    validate_layout(c)
    validate_run(c.run)
    if world_size is not None and world_size != c.layout.world_size:
        lay = c.layout
        raise ConfigError(f"world_size={world_size} does not match tp*cp*dp*pp="
                          f"{lay.tp}*{lay.cp}*{lay.dp}*{lay.pp}={lay.world_size}")
