"""The typed blocks of an :class:`.estimate.Estimate` and the small ones built here: what was
asked (:class:`Inputs`), the parameter counts (:class:`Parameters`) and the FLOPs
(:class:`Flops`).

Every block is a frozen dataclass whose ``as_dict`` gives the figures under their field
names, nested blocks as dicts, in field order; a field made with :func:`optional` is left
out while it is ``None`` (a figure that does not apply to this model, e.g. ``etp`` of a
dense one). ``parbench estimate --json`` prints ``as_dict``; everything else reads fields.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from ..layout import Layout
from ..options import Options
from . import flops as flop_model
from . import params as param_model
from .counting import Counting
from .shape import Shape


def optional(default: Any = None) -> Any:
    """A field left out of ``as_dict`` while it is ``None``."""
    return field(default=default, metadata={"optional": True})


def plain(value: Any) -> Any:
    """``value`` with every block (anything with ``as_dict``) turned into its dict."""
    if hasattr(value, "as_dict"):
        return value.as_dict()
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


class Block:
    """Base of the estimate's blocks: ``as_dict`` by fields (see the module doc)."""

    def as_dict(self) -> dict[str, Any]:
        out = {}
        for f in fields(self):  # type: ignore[arg-type]
            v = getattr(self, f.name)
            if v is None and f.metadata.get("optional"):
                continue
            out[f.name] = plain(v)
        return out


# ---- inputs ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Inputs(Block):
    """The configuration as counted: the layout's degrees and batch, the options read, the
    counting's bytes; with a model, its vocabulary (padded to a multiple of
    ``make_vocab_size_divisible_by * tp``) and counting choices, its architecture when it is
    not GPT-style, and its MoE fields (``etp`` resolved, ``edp``)."""

    micro_batch: int
    num_microbatches: int
    global_batch: int
    tp: int
    pp: int
    dp: int
    cp: int
    ep: int
    vpp: int
    zero_stage: int
    sp: bool
    recompute: str
    bytes_per_element: int
    #: what selective recomputation recomputes (Megatron's ``--recompute-modules``)
    recompute_modules: str | None = optional()
    vocab_size: int | None = optional()
    padded_vocab_size: int | None = optional()
    make_vocab_size_divisible_by: int | None = optional()
    attention: str | None = optional()
    causal_flops: str | None = optional()
    logits_bytes: int | None = optional()
    num_kv_heads: int | None = optional()
    mlp: str | None = optional()
    norm: str | None = optional()
    bias: bool | None = optional()
    etp: int | None = optional()
    edp: int | None = optional()
    moe_every: int | None = optional()
    moe_capacity_factor: float | None = optional()
    moe_top_k: int | None = optional()
    moe_router: str | None = optional()
    moe_bias_update_rate: float | None = optional()
    moe_router_groups: int | None = optional()
    moe_router_topk_groups: int | None = optional()
    moe_router_scaling: float | None = optional()


def _router_inputs(shape: Shape) -> dict[str, Any]:
    """The DeepSeek-V3 router settings an MoE model uses (``parbench.moe_rules``): the sigmoid
    score, the balancing bias's gamma, the groups, the gates' scaling; none for the default
    softmax router."""
    more: dict[str, Any] = {}
    if shape.moe_router != "softmax":
        more["moe_router"] = shape.moe_router
    if shape.moe_bias_update_rate:
        more["moe_bias_update_rate"] = shape.moe_bias_update_rate
    if shape.moe_router_groups:
        more.update(moe_router_groups=shape.moe_router_groups,
                    moe_router_topk_groups=shape.moe_router_topk_groups)
    if shape.moe_router_scaling != 1.0:
        more["moe_router_scaling"] = shape.moe_router_scaling
    return more


def layout_inputs(lay: Layout, options: Options, counting: Counting, **more: Any) -> Inputs:
    """The inputs every estimate states (``more``: the model's fields)."""
    return Inputs(micro_batch=lay.micro_batch_size, num_microbatches=lay.num_microbatches,
                  global_batch=lay.global_batch_size, tp=lay.tp, pp=lay.pp, dp=lay.dp,
                  cp=lay.cp, ep=lay.ep, vpp=lay.vpp, zero_stage=options.data.zero_stage,
                  sp=options.tensor.sp, recompute=options.recompute,
                  recompute_modules=options.recompute_modules
                  if options.recompute == "selective" else None,
                  bytes_per_element=counting.bytes_per_element, **more)


def shape_inputs(unpadded: Shape, padded: Shape, lay: Layout, options: Options,
                 counting: Counting) -> Inputs:
    """:func:`layout_inputs` with the model's vocabulary, architecture and MoE fields."""
    more: dict[str, Any] = {
        "vocab_size": unpadded.V, "padded_vocab_size": padded.V,
        "make_vocab_size_divisible_by": padded.make_vocab_size_divisible_by,
        "attention": counting.attention, "causal_flops": counting.causal_flops,
        "logits_bytes": counting.logits_bytes}
    if not padded.gpt_style:
        more.update(num_kv_heads=padded.kv_heads, mlp=padded.mlp, norm=padded.norm,
                    bias=padded.bias)
    if padded.moe:
        more.update(etp=lay.expert_tp, edp=lay.edp, moe_every=padded.moe_every,
                    moe_capacity_factor=padded.moe_capacity_factor,
                    moe_top_k=padded.moe_top_k, **_router_inputs(padded))
    return layout_inputs(lay, options, counting, **more)


# ---- parameters -----------------------------------------------------------------------------

@dataclass(frozen=True)
class StageParams(Block):
    """Parameters on one pipeline rank (one tensor/expert-parallel rank of it),
    :func:`.params.stage_params`; for an MoE model also its MoE layers and the split into
    ``dense`` (replicated over dp x cp) and ``expert`` (over edp) parameters."""

    stage: int
    layers: int
    embedding: int
    transformer: int
    head: int
    total: int
    moe_layers: int | None = optional()
    dense: int | None = optional()
    expert: int | None = optional()


@dataclass(frozen=True)
class Parameters(Block):
    """The parameter counts of :func:`.params.param_counts` (the vocabulary padded;
    ``total_unpadded_vocab`` when the padding changed it; ``mtp``: the multi-token prediction
    modules' share of ``total``). ``by_layer_kind``: an MoE model's
    two kinds of layer, whole and per rank, as :func:`.params.layer_split` gives them."""

    total: int
    active: int
    per_layer: int
    per_layer_textbook: int | None
    embedding: int
    head: int
    per_rank_per_layer: int
    stages: list[StageParams]
    moe_layers: int | None = optional()
    moe_every: int | None = optional()
    by_layer_kind: dict[str, dict] | None = optional()
    total_unpadded_vocab: int | None = optional()
    mtp: int | None = optional()

    @property
    def most_loaded_stage(self) -> int:
        """Parameters of the most loaded pipeline rank."""
        return max(st.total for st in self.stages)


def parameters(padded: Shape, unpadded: Shape, lay: Layout) -> Parameters:
    """The parameter block: every count at the layout's tp, pp, ep, etp and vpp."""
    counts = param_model.param_counts(padded, lay.pp, lay.tp, lay.ep, lay.vpp, etp=lay.etp,
                                      first=lay.first_stage_layers,
                                      last=lay.last_stage_layers)
    counts["stages"] = [StageParams(**st) for st in counts["stages"]]
    if padded.V != unpadded.V:
        counts["total_unpadded_vocab"] = param_model.total_params(unpadded)
    return Parameters(**counts)


@dataclass(frozen=True)
class ParamCount(Block):
    """A bare parameter count (the ZeRO paper's examples)."""

    total: float


# ---- FLOPs ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Flops(Block):
    """FLOPs of one iteration (global batch): forward, training (3 x forward; 4 x with full
    recomputation), Megatron's Eq. 3 where its GPT shape applies (Narayanan et al. 2021;
    ``None`` otherwise), the 6N rule (Kaplan et al. 2020) on the active parameters, and one
    device's share of the training FLOPs at this layout's recomputation."""

    forward_per_iteration: float
    training_per_iteration: float
    training_per_iteration_recompute: float
    megatron_eq3: float | None
    params_rule_6N: float  # noqa: N815 - the rule's name
    per_device_training: float
    causal_flops: str


def flop_counts(shape: Shape, lay: Layout, options: Options, counting: Counting) -> Flops:
    """The FLOPs block of ``shape`` (vocabulary padded) at the layout's global batch."""
    B, c = lay.global_batch_size, counting.causal_flops  # noqa: N806
    dense4 = not shape.moe and shape.f == 4 * shape.h and shape.gpt_style \
        and not shape.mtp_layers
    training = flop_model.shape_training_flops
    return Flops(
        forward_per_iteration=flop_model.shape_forward_flops(shape, B, causal=c),
        training_per_iteration=training(shape, B, causal=c),
        training_per_iteration_recompute=training(shape, B, recompute=True, causal=c),
        megatron_eq3=flop_model.megatron_eq3_flops(B, shape.s, shape.l, shape.h, shape.V)
        if dense4 else None,
        params_rule_6N=flop_model.params_rule_flops(param_model.active_params(shape),
                                                    B * shape.s),
        per_device_training=training(shape, B, recompute=options.recompute == "full",
                                     causal=c) / lay.world_size,
        causal_flops=c)


@dataclass(frozen=True)
class ParamsRuleFlops(Block):
    """Training FLOPs per token by the 6N rule (8N with full recomputation)."""

    per_token_training: float
    per_token_training_recompute: float


def params_rule(psi: float) -> ParamsRuleFlops:
    return ParamsRuleFlops(flop_model.params_rule_flops(psi, 1),
                           flop_model.params_rule_flops(psi, 1, True))
