"""``estimate``: the whole analytic model of one configuration, as a typed :class:`Estimate`.

``estimate(shape, layout, options, counting)`` takes the model, the parallel
:class:`~parbench.layout.Layout` (degrees, micro-batch size, micro-batches per data-parallel
rank), the families' :class:`~parbench.options.Options` it reads (``sp``, ``zero_stage``,
``recompute``, ``cp_algorithm``) and a :class:`.counting.Counting` (how to count: bytes per
element, accounting, attention, causal FLOPs, logits bytes, generation). The layout's rules
(``Layout.check_model``) are checked first, once. ``estimate_params`` is the ZeRO paper's
mode: a bare parameter count instead of a model.

All figures are bytes or FLOPs unless a name says otherwise (``*_gb`` = 10^9 bytes, the ZeRO
paper's unit). Per-rank figures are for the most loaded pipeline rank for memory and for one
rank of the first pipeline stage for communication. With context parallelism, gradients are
reduced and ZeRO partitions over the dp x cp ranks, as in Megatron-Core.

MoE models (Megatron-Core layout: ``Layout.edp``): dense parameters (the router included) are
replicated over dp x cp, expert parameters over the expert-data-parallel group
``edp = tp cp dp / (etp ep)``. Model states are computed for each group with its own size --
ZeRO partitions each group's flat buffer over its own ranks, as Megatron-Core's distributed
optimizer does -- and gradient traffic is reported on axis ``dp`` for the dense part and
``edp`` for the expert part. Expert all-to-alls (GShard, Lepikhin et al. 2020; Switch, Fedus
et al. 2021), the router and expert FLOPs and the routed activations
(:func:`.activations.moe_layer_activation_bytes`) are counted on MoE layers only, every
``moe_every``-th; the capacity factor is the model's (``moe_capacity_factor``).

The vocabulary is padded to a multiple of ``make_vocab_size_divisible_by * tp`` (a field of
the shape; Megatron-LM's ``_vocab_size_with_padding``, 128 there, 1 -- a multiple of tp -- for
the reference model) before every count: embedding, head, logit FLOPs, logits memory
(``inputs.padded_vocab_size``; ``parameters.total_unpadded_vocab`` when it differs).
``Counting.accounting``: bytes per parameter of the model states (:mod:`.memory`;
``megatron`` with ``zero_stage=1`` is Megatron-Core's distributed optimizer, 6 + 12/d bytes;
``deepspeed18`` with ``zero_stage=3`` adds DeepSpeed's largest-layer buffer, ``buffer``).
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Iterator

from ..layout import ConfigError, Layout
from ..options import Options
from . import comm
from . import params as param_model
from .counting import Counting
from .estimate_activations import Activations, activation_block
from .estimate_blocks import (Block, Flops, Inputs, ParamCount, Parameters, ParamsRuleFlops,
                              flop_counts, layout_inputs, optional, parameters, params_rule,
                              shape_inputs)
from .estimate_states import (ModelFits, ModelStatesBlock, model_states, moe_model_states,
                              with_layer_buffer)
from .estimate_traffic import Communication, communication_block
from .kv_cache import KVCache, kv_cache
from .shape import Shape, shape_from


@dataclass(frozen=True)
class Memory(Block):
    """Bytes per rank: the model states, and (with a model) the activations."""

    model_states: ModelStatesBlock
    activations: Activations | None = optional()

    @property
    def per_rank(self) -> float:
        """Model states and the first stage's activations (Korthikanti's count)."""
        acts = self.activations.first_stage_korthikanti if self.activations else 0.0
        return self.model_states.selected.total + acts


class _Sections(Block):
    def sections(self) -> Iterator[tuple[str, Block | dict]]:
        """The blocks that apply, by name, in the order ``as_dict`` gives them."""
        for f in fields(self):  # type: ignore[arg-type]
            if getattr(self, f.name) is not None:
                yield f.name, getattr(self, f.name)


@dataclass(frozen=True)
class Estimate(_Sections):
    """Parameters, FLOPs, memory per rank and communication of one configuration; the KV
    cache with ``Counting.generate``; ``largest_model_fits`` where a caller adds it."""

    inputs: Inputs
    parameters: Parameters
    flops: Flops
    memory: Memory
    communication: Communication
    kv_cache: KVCache | None = optional()
    largest_model_fits: ModelFits | None = optional()


@dataclass(frozen=True)
class ParamsEstimate(_Sections):
    """The ZeRO paper's estimate of a bare parameter count: the 6/8 FLOPs-per-token rule, the
    model states (tp x pp model parallelism dividing the model) and the data-parallel
    traffic per axis."""

    inputs: Inputs
    parameters: ParamCount
    flops: ParamsRuleFlops
    memory: Memory
    communication: dict[str, dict]
    largest_model_fits: ModelFits | None = optional()


def estimate(shape: Shape | Any, layout: Layout, options: Options = Options(),
             counting: Counting = Counting()) -> Estimate:
    """Parameters, FLOPs, memory per rank and communication per axis of ``shape`` (a
    :class:`Shape` or any object with its field names) trained on ``layout`` with
    ``options``, counted as ``counting`` says. Bad settings raise ``ConfigError`` (a
    ``ValueError``) naming the field, the value and the rule."""
    unpadded = shape_from(shape)
    layout.check_model(unpadded, sp=options.tensor.sp)
    padded_v = unpadded.padded_vocab(layout.tp)
    shp = unpadded if padded_v == unpadded.V else replace(unpadded, vocab_size=padded_v)
    s_local = shp.s // layout.cp
    params = parameters(shp, unpadded, layout)
    return Estimate(
        inputs=shape_inputs(unpadded, shp, layout, options, counting),
        parameters=params,
        flops=flop_counts(shp, layout, options, counting),
        memory=Memory(_states(shp, params, layout, options, counting),
                      activation_block(shp, layout, options, counting, s_local)),
        communication=communication_block(shp, layout, options, counting, s_local,
                                          params.stages[0]),
        kv_cache=None if counting.generate is None else kv_cache(
            shp, layout.micro_batch_size, counting.generate, tp=layout.tp, pp=layout.pp,
            vpp=layout.vpp, bytes_per_element=counting.bytes_per_element,
            ends=(layout.first_stage_layers, layout.last_stage_layers)))


def _states(shape: Shape, params: Parameters, lay: Layout, options: Options,
            counting: Counting) -> ModelStatesBlock:
    """The model states of the most loaded pipeline rank, DeepSpeed's layer buffer added."""
    zero, chosen = options.data.zero_stage, counting.accounting_name
    if shape.moe:
        block = moe_model_states(params.stages, lay, zero, chosen)
    else:
        block = model_states(params.most_loaded_stage, lay.dp_cp, zero, chosen)
    largest = param_model.largest_module_params(shape, lay.tp, lay.ep, etp=lay.etp)
    return with_layer_buffer(block, largest)


def estimate_params(psi: float, layout: Layout, options: Options = Options(),
                    counting: Counting = Counting()) -> ParamsEstimate:
    """The ZeRO paper's examples (Rajbhandari et al. 2020, Table 1 / Fig. 1): ``psi``
    parameters, ``tp * pp`` model parallelism dividing them, ZeRO over dp: the model states
    per rank, the FLOPs-per-token rule and the data-parallel traffic."""
    if isinstance(psi, bool) or not isinstance(psi, (int, float)) or not psi > 0:
        raise ConfigError(f"params={psi!r} must be a positive number")
    zero, e = options.data.zero_stage, counting.bytes_per_element
    psi_rank = psi / (layout.tp * layout.pp)
    traffic = comm.zero_traffic(int(round(psi_rank)), layout.dp, zero, e, e) \
        if layout.dp > 1 else []
    return ParamsEstimate(
        inputs=layout_inputs(layout, options, counting),
        parameters=ParamCount(float(psi)),
        flops=params_rule(float(psi)),
        memory=Memory(model_states(psi_rank, layout.dp, zero, counting.accounting_name)),
        communication=comm.summarize(traffic))
