"""The peak bytes of each pipeline rank -- model states, the activations of the micro-batches
in flight, the last stage's logits -- counted with the same rules as ``estimate``'s memory
block, so that the time model's "fits" (and hence ``parbench plan``'s pruning) is
``estimate``'s figure and not a second count.

Per pipeline rank r of a layout (``stage_layer_indices``: the layers it holds, each counted
as its kind):

- **model states** (Rajbhandari et al. 2020, Sec. 5.1): the exact padded flat-buffer figure
  of :func:`.memory.zero_model_states_exact` under the chosen accounting -- dense parameters
  partitioned over dp x cp, on an MoE model the expert parameters over edp (Megatron-Core's
  distributed optimizer, as :func:`.estimate_states.moe_model_states`); DeepSpeed's ZeRO-3
  largest-layer buffer where the accounting has one (:func:`.estimate_states.with_layer_buffer`);
- **activations** (Korthikanti et al. 2022, Table 2, eager or flash attention:
  :func:`.activations.layer_activation_bytes`; an MoE layer's routed terms:
  :func:`.activations.moe_layer_activation_bytes`): the rank's layers, each as its kind,
  times the micro-batches in flight at its peak (``in_flight(r)``: the schedule's memory
  rule; Korthikanti et al. Sec. 4.2.3 for 1F1B);
- **full recomputation's working layer**: while a layer is recomputed it holds its full
  activations (Korthikanti et al. 2022, Sec. 5: the recomputed layer's activations are
  materialised again before its backward), one layer of the rank's largest kind;
- **logits** (Korthikanti et al. 2022, Sec. 4.3): the last rank's one micro-batch of
  ``logits_bytes`` x b s/cp V'/tp (:func:`.activations.logits_bytes`).

Not counted (as in ``estimate``): allocator fragmentation, communication buffers,
temporaries.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Callable

from ..layout import Layout
from ..options import Options
from . import activations, memory
from . import params as param_model
from .counting import Counting
from .estimate_traffic import routed_rows
from .recompute_modules import recompute_key, split_key
from .shape import Shape, moe_layer_count, shape_from
from .stages import stage_layer_indices


@dataclass(frozen=True)
class RankMemory:
    """One pipeline rank's peak bytes by term (``total``: their sum)."""

    stage: int
    model_states: float
    activations: float
    recompute_working: float
    logits: float
    in_flight_microbatches: float
    activation_per_layer: float
    activation_per_moe_layer: float | None
    accounting: str

    @property
    def total(self) -> float:
        return self.model_states + self.activations + self.recompute_working + self.logits


def padded_shape(shape: Shape, tp: int) -> Shape:
    """``shape`` with the vocabulary padded for tp (``Shape.padded_vocab``: Megatron-LM's
    ``_vocab_size_with_padding``), as ``estimate`` counts every figure."""
    v = shape.padded_vocab(tp)
    return shape if v == shape.V else replace(shape, vocab_size=v)


def layer_bytes(shape: Shape, lay: Layout, sp: bool, recompute: str,
                counting: Counting) -> tuple[float, float | None]:
    """(a dense layer's, an MoE layer's or None) activation bytes per micro-batch on one
    rank (``recompute``: a ``recompute_modules.recompute_key`` word): Korthikanti's count at s/cp tokens with the counting's attention and element
    bytes, the routed terms added on an MoE layer (``estimate``'s ``per_layer_korthikanti``
    and ``per_moe_layer_korthikanti``)."""
    s_local, t, e = shape.s // lay.cp, lay.tp, counting.bytes_per_element
    recompute, modules = split_key(recompute)
    dense = activations.layer_activation_bytes(
        s_local, lay.micro_batch_size, shape.h, shape.a, t, sp, recompute, shape.f,
        bytes_per_element=e, attention=counting.attention, modules=modules,
        **shape.attention_keywords())
    if not shape.moe:
        return dense, None
    tokens, _, rows = routed_rows(shape, lay.micro_batch_size, s_local, t, sp)
    moe = activations.moe_layer_activation_bytes(
        dense, s=s_local, b=lay.micro_batch_size, h=shape.h, f=shape.f, tp=t, tokens=tokens,
        rows=rows, num_experts=shape.num_experts, etp=lay.expert_tp, recompute=recompute,
        bytes_per_element=e, mlp=shape.mlp, expert_f=shape.expert_f,
        shared_f=shape.moe_shared_expert_size, modules=modules)["total"]
    return dense, moe


@lru_cache(maxsize=1024)
def _stages(shp: Shape, pp: int, tp: int, ep: int, vpp: int, etp: int, ends: tuple):
    """Each pipeline rank's parameters (``params.stage_params``) and its (layers, MoE
    layers) -- cached, the same for every ZeRO stage, recomputation and micro-batch size.
    ``ends``: the uneven first and last rank's layers (0: even)."""
    first, last = ends
    rows = param_model.stage_params(shp, pp, tp, ep, vpp, etp=etp or None, first=first,
                                    last=last)
    kinds = [(len(ix), moe_layer_count(shp, ix) if shp.moe else 0)
             for ix in stage_layer_indices(shp.num_layers, pp, vpp, first=first, last=last)]
    return rows, kinds


@lru_cache(maxsize=65536)
def _exact(numel: int, group: int, zero: int, accounting: str) -> float:
    return memory.zero_model_states_exact(numel, group, zero, accounting)["padded"].total


def _states(row: dict, lay: Layout, zero: int, accounting: str) -> float:
    """The rank's padded flat-buffer model states: dense over dp x cp, experts over edp."""
    if "expert" not in row:
        return _exact(int(row["total"]), lay.dp_cp, zero, accounting)
    return _exact(int(row["dense"]), lay.dp_cp, zero, accounting) + \
        _exact(int(row["expert"]), lay.edp, zero, accounting)


def _layer_buffer(shape: Shape, lay: Layout, zero: int, accounting: str) -> float:
    """DeepSpeed's ZeRO-3 buffer of the largest module, where the accounting has one."""
    per_param = memory.get_accounting(accounting).layer_buffer
    if not per_param or zero != 3:
        return 0.0
    return per_param * param_model.largest_module_params(shape, lay.tp, lay.ep, etp=lay.etp)


def rank_memory(shape, lay: Layout, options: Options, counting: Counting,
                in_flight: Callable[[int], float]) -> list[RankMemory]:
    """Every pipeline rank's peak bytes (module doc); ``in_flight(r)``: micro-batches' worth
    of rank r's layers it holds at its peak."""
    per_rank, dense, moe = _static_of(shape, lay, options, counting)
    return [_rank(r, row, in_flight(r), dense, moe, counting)
            for r, row in enumerate(per_rank)]


def _static_of(shape, lay: Layout, options: Options, counting: Counting):
    """:func:`_static` for the layout's grid (its degrees and micro-batch size)."""
    grid = (lay.tp, lay.cp, lay.ep, lay.etp, lay.dp, lay.pp, lay.vpp, lay.micro_batch_size,
            lay.first_stage_layers, lay.last_stage_layers)
    return _static_grid(shape_from(shape), grid, options.tensor.sp and lay.tp > 1,
                        recompute_key(options), options.data.zero_stage, counting)


@lru_cache(maxsize=65536)
def _static_grid(shape: Shape, grid: tuple, sp: bool, mode: str, zero: int,
                 counting: Counting):
    """:func:`_static` keyed by the grid's numbers: the padded shape and the grid's Layout
    are built once per grid, not once per candidate the planner prices."""
    tp, cp, ep, etp, dp, pp, vpp, b, first, last = grid
    lay = Layout(tp=tp, cp=cp, ep=ep, etp=etp, dp=dp, pp=pp, vpp=vpp, micro_batch_size=b,
                 first_stage_layers=first, last_stage_layers=last)
    return _static(padded_shape(shape, tp), lay, sp, mode, zero, counting)


def _rank(r: int, row: tuple, flight: float, dense: float, moe, counting: Counting
          ) -> RankMemory:
    states, held, work, logits = row
    return RankMemory(stage=r, model_states=states, activations=held * flight,
                      recompute_working=work, logits=logits, in_flight_microbatches=flight,
                      activation_per_layer=dense, activation_per_moe_layer=moe,
                      accounting=counting.accounting_name)


def _static(shp: Shape, lay: Layout, sp: bool, mode: str, zero: int, counting: Counting):
    """What does not depend on the schedule: per rank (model states, one micro-batch's
    activations of its layers, full recomputation's working layer, logits), and the dense
    and MoE layer's bytes (cached through :func:`_static_grid`): :func:`rank_states` and
    :func:`rank_activations` side by side."""
    grid = (lay.tp, lay.cp, lay.ep, lay.etp, lay.dp, lay.pp, lay.vpp,
            lay.first_stage_layers, lay.last_stage_layers)
    states = rank_states(shp, grid, zero, counting.accounting_name)
    held, work, logits, dense, moe = rank_activations(shp, grid, lay.micro_batch_size, sp,
                                                      mode, counting)
    return tuple(zip(states, held, work, logits)), dense, moe


@lru_cache(maxsize=65536)
def rank_states(shp: Shape, grid: tuple, zero: int, acc: str) -> tuple[float, ...]:
    """Each pipeline rank's padded model states (and DeepSpeed's ZeRO-3 buffer) of the
    padded shape on ``grid`` = (tp, cp, ep, etp, dp, pp, vpp, first, last): the same for
    every micro-batch size, recomputation and schedule (the planner counts whole groups
    of layouts with it)."""
    tp, cp, ep, etp, dp, pp, vpp, first, last = grid
    lay = Layout(tp=tp, cp=cp, ep=ep, etp=etp, dp=dp, pp=pp, vpp=vpp,
                 first_stage_layers=first, last_stage_layers=last)
    rows, _ = _stages(shp, pp, tp, ep, vpp, etp, (first, last))
    buffer = _layer_buffer(shp, lay, zero, acc)
    return tuple(_states(row, lay, zero, acc) + buffer for row in rows)


@lru_cache(maxsize=4096)
def _layer_bytes(shp: Shape, tp: int, cp: int, expert_tp: int, b: int, sp: bool, mode: str,
                 counting: Counting) -> tuple[float, float | None]:
    """:func:`layer_bytes` by the layout's numbers it reads (tp, cp, expert tp, b)."""
    lay = Layout(tp=tp, cp=cp, etp=0 if expert_tp == tp else expert_tp, dp=expert_tp,
                 micro_batch_size=b)  # dp: any that lets the expert grid pass its rule
    return layer_bytes(shp, lay, sp, mode, counting)


@lru_cache(maxsize=65536)
def rank_activations(shp: Shape, grid: tuple, b: int, sp: bool, mode: str,
                     counting: Counting) -> tuple:
    """(held, working, logits) per pipeline rank -- one micro-batch's activations of its
    layers, full recomputation's working layer, the last rank's logits -- and the dense and
    MoE layer's bytes, of the padded shape on ``grid`` (as :func:`rank_states`) at
    micro-batch size ``b``: the same for every ZeRO stage and schedule."""
    tp, cp, ep, etp, dp, pp, vpp, first, last = grid
    dense, moe = _layer_bytes(shp, tp, cp, etp or tp, b, sp, mode, counting)
    working = _layer_bytes(shp, tp, cp, etp or tp, b, sp, "none", counting) \
        if mode == "full" else (0.0, None)
    _, kinds = _stages(shp, pp, tp, ep, vpp, etp, (first, last))
    logits = activations.logits_bytes(shp.s // cp, b, shp.V, tp, counting.logits_bytes)
    held = tuple((n_layers - n_moe) * dense + n_moe * (moe or 0.0) for n_layers, n_moe in kinds)
    work = tuple((working[1] if n_moe else working[0]) or 0.0 for _, n_moe in kinds)
    last_logits = tuple(logits if r == pp - 1 else 0.0 for r in range(len(kinds)))
    return held, work, last_logits, dense, moe


def peak_rank_memory(shape, lay: Layout, options: Options, counting: Counting,
                     in_flight: Callable[[int], float]) -> RankMemory:
    """The most loaded pipeline rank of :func:`rank_memory` (the first of equal loads),
    found from the ranks' sums before one record is built (the planner's hot path)."""
    per_rank, dense, moe = _static_of(shape, lay, options, counting)
    best, best_r, best_flight = -1.0, 0, 0.0
    for r, (states, held, work, logits) in enumerate(per_rank):
        flight = in_flight(r)
        total = states + held * flight + work + logits
        if total > best:
            best, best_r, best_flight = total, r, flight
    return _rank(best_r, per_rank[best_r], best_flight, dense, moe, counting)
