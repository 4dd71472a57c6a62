"""The data-parallel gradient synchronisation (buckets, ZeRO stages, overlap) and the memory
per rank of the time model."""
from __future__ import annotations

import math

from ..analytic import rank_memory
from ..analytic.counting import Counting
from ..analytic import params as aparams
from ..schedules import get_spec
from .costs import _bias, _cache, _e, _gated, _kv, _LinkFn, _param_shape, _vocab
from .training import Training
from .profile import Profile

# ---------------------------------------------------------------------------------------
# data parallel
# ---------------------------------------------------------------------------------------

def _bucket_count(numel_tensors: list[int], cap: int) -> list[int]:
    """The bucket rule (``analytic.data_parallel``): reverse order, cut at ``cap`` elements;
    returns each bucket's elements."""
    out, n = [], 0
    for x in reversed(numel_tensors):
        n += x
        if n >= cap:
            out.append(n)
            n = 0
    if n:
        out.append(n)
    return out


def _rank_tensors(shape, trn: Training, stage: int) -> list[int]:
    """Parameter tensors (elements) a rank of pipeline stage ``stage`` holds, forward order,
    tp-split (replicated ones whole)."""
    lay = trn.layout
    h, f, tp = shape.h, shape.f, lay.tp
    kv = _kv(shape)
    bias = _bias(shape)
    norm = [h, h] if getattr(shape, "norm", "layernorm") == "layernorm" else [h]
    block = list(norm) + [(h + 2 * kv) * h // tp] + ([(h + 2 * kv) // tp] if bias else []) \
        + [h * h // tp] + ([h] if bias else []) + list(norm)
    for _ in range(2 if _gated(shape) else 1):
        block += [f * h // tp] + ([f // tp] if bias else [])
    block += [h * f // tp] + ([h] if bias else [])
    layers = lay.stage_layers(shape.l)[stage]
    out: list[int] = []
    if stage == 0:
        out += [_vocab(shape, tp) * h]
        if getattr(shape, "position_embeddings", True):
            out += [shape.s * h]
    out += block * layers
    if stage == lay.pp - 1:
        out += list(norm)
        if not shape.tie_embeddings or lay.pp > 1:
            out += [_vocab(shape, tp) * h]
    return out


def dp_costs(shape, trn: Training, profile: Profile, stage: int, psi_rank: float,
             bwd_window_last: float, bwd_window_each: float, fwd_window_each: float,
             n_tensors: int) -> tuple[float, float, dict]:
    """(exposed dp seconds per step, total dp seconds, detail) for one rank of ``stage``:
    gradient reduction (and ZeRO's gathers) over dp x cp, overlapped as the module doc says."""
    lay, opt = trn.layout, trn.options
    n = lay.dp * lay.cp
    if n <= 1:
        return 0.0, 0.0, {}
    e = _e(trn.dtype)
    m = lay.num_microbatches
    link = _LinkFn(profile, trn.ranks_per_node or profile.ranks_per_node)(lay.tp, n)
    o = profile.overlap if opt.data.overlap_grad_reduce else 0.0
    cap_bytes = opt.data.bucket_mb * 2 ** 20 if math.isfinite(opt.data.bucket_mb) else math.inf
    key = ("buckets", shape, lay.tp, lay.pp, lay.vpp, lay.first_stage_layers,
           lay.last_stage_layers, stage, opt.data.zero_stage,
           opt.data.bucket_mb, e)
    cache = _cache(profile)
    buckets = cache.get(key)
    if buckets is None:
        if not math.isfinite(cap_bytes):
            buckets = [psi_rank]
        else:
            cap = max(1, int(cap_bytes // e))
            tensors = _rank_tensors(shape, trn, stage)
            if opt.data.zero_stage == 0:
                buckets = _bucket_count(tensors, cap)
            else:  # units: whole layers grouped by the same rule
                buckets = _bucket_count(_layer_units(tensors, shape, trn, stage), cap)
        cache[key] = buckets
    ct = _per_size(profile.collective_time)
    pad = lambda x: -(-x // n) * n  # noqa: E731
    detail: dict[str, float] = {}
    if opt.data.zero_stage == 0:
        times = [ct("all_reduce", n, x * e, link) for x in buckets]
        total = sum(times)
        hidden = o * min(bwd_window_last, total - times[-1] if opt.data.overlap_grad_reduce
                         else 0.0)
        detail["all_reduce"] = total
        return total - max(hidden, 0.0), total, detail
    rs = [ct("reduce_scatter", n, pad(x) * e, link) for x in buckets]
    ag = [ct("all_gather", n, pad(x) * e, link) for x in buckets]
    t_rs, t_ag = sum(rs), sum(ag)
    if opt.data.zero_stage == 1:
        hidden = o * min(bwd_window_last, t_rs - rs[-1])
        exposed = t_rs - hidden + t_ag
        detail.update(reduce_scatter=t_rs, all_gather=t_ag)
        return exposed, t_rs + t_ag, detail
    if opt.data.zero_stage == 2:
        hidden = o * min(bwd_window_each, t_rs - rs[-1])
        exposed = m * (t_rs - hidden) + t_ag
        detail.update(reduce_scatter=m * t_rs, all_gather=t_ag)
        return exposed, m * t_rs + t_ag, detail
    # ZeRO-3: gathers before forward and backward (prefetched), RS in backward, each mb
    hidden_f = o * min(fwd_window_each, t_ag - ag[0])
    hidden_b = o * min(bwd_window_each, max(t_ag + t_rs - ag[-1] - rs[-1], 0.0))
    per_mb = (t_ag - hidden_f) + (t_ag + t_rs - hidden_b)
    detail.update(all_gather=2 * m * t_ag, reduce_scatter=m * t_rs)
    return m * per_mb, m * (2 * t_ag + t_rs), detail


def _per_size(collective_time):
    """``collective_time`` priced once per distinct (op, group, bytes, link): the buckets of
    a rank are mostly of one size, and the planner prices thousands of layouts."""
    memo: dict = {}

    def ct(op: str, n: int, nbytes: float, link: str) -> float:
        key = (op, n, nbytes, link)
        hit = memo.get(key)
        if hit is None:
            hit = memo[key] = collective_time(op, n, nbytes, link)
        return hit
    return ct


def _layer_units(tensors: list[int], shape, trn: Training, stage: int) -> list[int]:
    """Group a rank's tensors into layer units: embedding, each block, head."""
    lay = trn.layout
    layers = lay.stage_layers(shape.l)[stage]
    first = 2 if (stage == 0 and getattr(shape, "position_embeddings", True)) else \
        (1 if stage == 0 else 0)
    last_n = 0
    if stage == lay.pp - 1:
        norm_n = 2 if getattr(shape, "norm", "layernorm") == "layernorm" else 1
        last_n = norm_n + (0 if (shape.tie_embeddings and lay.pp == 1) else 1)
    body = tensors[first:len(tensors) - last_n]
    blen = len(body) // layers if layers else 0
    units = []
    if first:
        units.append(sum(tensors[:first]))
    for i in range(layers):
        units.append(sum(body[i * blen:(i + 1) * blen]))
    if last_n:
        units.append(sum(tensors[len(tensors) - last_n:]))
    return units


# ---------------------------------------------------------------------------------------
# memory
# ---------------------------------------------------------------------------------------

_STAGES: dict = {}


def _stage_params(shape, trn: Training) -> list[dict]:
    """``analytic.params.stage_params`` of the layout, cached (the planner asks again and
    again for the same degrees)."""
    lay = trn.layout
    key = (shape, lay.pp, lay.tp, lay.ep, lay.vpp, lay.etp, lay.first_stage_layers,
           lay.last_stage_layers)
    hit = _STAGES.get(key)
    if hit is None:
        if len(_STAGES) > 4096:
            _STAGES.clear()
        hit = _STAGES[key] = aparams.stage_params(
            _param_shape(shape, lay.tp), lay.pp, lay.tp, lay.ep, lay.vpp, etp=lay.etp or None,
            first=lay.first_stage_layers, last=lay.last_stage_layers)
    return hit


def memory_per_rank(shape, trn: Training) -> tuple[float, dict]:
    """(bytes, detail) of the most loaded pipeline rank: ``estimate``'s count
    (:func:`parbench.analytic.rank_memory.peak_rank_memory`: exact padded model states under
    the training's accounting, MoE layers as MoE, eager or flash attention, the last stage's
    fp32 logits) with the schedule's micro-batches in flight (:func:`_inflight`); cached per
    layout and options, since the planner asks for the same figures again and again."""
    lay, opt = trn.layout, trn.options
    key = (shape, lay, opt.tensor.sp, opt.recompute, opt.recompute_modules,
           opt.data.zero_stage, trn.dtype,
           trn.accounting, trn.attention)
    hit = _MEMORY.get(key)
    if hit is None:
        if len(_MEMORY) > 65536:
            _MEMORY.clear()
        hit = _MEMORY[key] = _peak(shape, trn)
    return hit[0], dict(hit[1])


_MEMORY: dict = {}


def _peak(shape, trn: Training) -> tuple[float, dict]:
    lay = trn.layout
    counting = Counting(bytes_per_element=_e(trn.dtype), accounting=trn.accounting,
                        attention=trn.attention)
    p, m, v = lay.pp, lay.num_microbatches, lay.vpp
    peak = rank_memory.peak_rank_memory(shape, lay, trn.options, counting,
                                        lambda r: _inflight(lay.schedule, p, m, r, v))
    return peak.total, {
        "stage": peak.stage, "model_states": peak.model_states,
        "activations": peak.activations + peak.recompute_working, "logits": peak.logits,
        "in_flight_microbatches": peak.in_flight_microbatches, "accounting": peak.accounting,
        "attention": trn.attention, "activation_per_layer": peak.activation_per_layer,
        "activation_per_moe_layer": peak.activation_per_moe_layer}


def _inflight(name: str, p: int, m: int, rank: int, v: int) -> float:
    """Micro-batches' worth of the rank's layers whose activations rank ``rank`` holds at
    its peak: the schedule's memory rule (``ScheduleSpec.memory``, the paper's)."""
    if p == 1:
        return 1
    return get_spec(name).memory(p, m, v, rank)
