"""The time model: one training step of a layout on a device profile, priced op by op.

``predict_step(shape, layout, profile) -> StepTime``. The rules, each with its source:

**Compute** (per rank, per micro-batch, per layer). The reference layer's operators at the
rank's local shapes -- T = b s/cp tokens, heads a/tp, widths f/tp and (h + 2 h_kv)/tp: the four
linears' GEMMs forward, and backward the input-gradient GEMM (B) and the weight-gradient GEMM
(W) of each (Narayanan et al. 2021 App.: backward = 2 x forward), priced by
:meth:`Profile.gemm_time` (measured at these shapes after ``calibrate model=...``, else the
measured rate interpolated in FLOPs, else by shape on a preset: the achievable matmul rate
times the wave efficiency, or the operands' bytes over the memory bandwidth); the attention
core forward and backward (:meth:`Profile.attention_time`: one fused kernel under
``attention=flash`` or on a calibrated profile, else unfused, its scores through memory); the memory-bound operators (two LayerNorms, two
residual adds, the activation, bias gradients; under ``grad_accumulation=unfused`` each
micro-batch's add into the gradient buffer, :mod:`.grad_accumulation`) as bytes over the memory
bandwidth; and every eager operator and autograd node at the profile's fixed costs (zero on the
GPU presets: kernel launches run ahead of the device). Embedding (first stage) and the LM head
with its cross-entropy (last stage) likewise. The optimizer: AdamW per parameter tensor and
element of the rank's shard (ZeRO >= 1 steps 1/dp of it).

**Recomputation** (Korthikanti et al. 2022, Sec. 5): ``full`` repeats each layer's forward
(its tensor-parallel collectives included) before its backward; ``selective`` repeats the
attention core only.

**Communication**: every collective of the layout from the closed forms of
``parbench.analytic`` (the same message sizes the ledger measures), priced by the profile's
alpha-beta fit per op and group size, on the link the group lies on (Megatron-Core's rank
order tp, cp, dp, pp: a group is inside a node when stride x size <= ranks per node).
Overlap, per scheme:

- tensor parallelism (Megatron all-reduces, or SP's all-gathers and reduce-scatters):
  synchronous, on the critical path, never overlapped (Shoeybi et al. 2019; Korthikanti
  et al. 2022 leave it exposed);
- expert all-to-alls and Ulysses all-to-alls: exposed (Lepikhin et al. 2020; Jacobs et al.
  2023);
- ring attention: each K/V hop overlaps the attention block of the previous one (Liu et al.
  2023, Sec. 3); exposed: max(0, hop - overlap x block);
- data parallelism: the gradient buckets (DDP, ZeRO-0) and the reduce-scatters (ZeRO-1/2/3)
  overlap the backward of the last micro-batch (ZeRO-2/3: of every micro-batch), all but the
  last bucket (Li et al. 2020, Sec. 3.2.3); ZeRO-1/2's all-gather of the updated parameters
  is exposed; ZeRO-3's parameter all-gathers are prefetched during the previous unit's
  compute, all but the first (Rajbhandari et al. 2020, Sec. 7.2.2); "overlap" is scaled by the
  profile's ``overlap`` fraction;
- pipeline point-to-point: the latency of each cross-rank dependency, inside the simulator.

**Pipeline**: the schedule (``parbench.schedules``) simulated with the per-virtual-stage costs
(tf, tb, tw with the stage's layers, the embedding on the first, the head on the last, and the
exposed tp/cp/ep time inside them) and the p2p time; results are cached per (schedule, p, m,
v, costs normalised and rounded to 3 significant figures, 2 for long schedules), so a
planner's thousands of calls reuse a few simulations. ``bubble_s`` is the makespan minus the busiest rank's busy time.

**MFU** (Korthikanti et al. 2022, Sec. 6 / App. A; Chowdhery et al. 2022, App. B): model
FLOPs of the step without recomputation, 3 x the forward (``analytic.flops``), over
(step time x devices x the device's peak for the dtype).

**Memory** per rank: the most loaded pipeline rank's model states (ZeRO partition over dp x cp
for dense parameters, over edp for experts; accounting: mixed-precision Adam for 16-bit, fp32
AdamW for fp32) plus its activations (Korthikanti et al. Table 2 per layer, times the layers
and micro-batches in flight under the schedule) and the last stage's fp32 logits. Not
counted: allocator fragmentation, communication buffers, temporaries.
"""
from __future__ import annotations

from functools import lru_cache

from ..analytic.shape import Shape, shape_from
from ..config import ConfigError
from ..schedules import ScheduleSpec, WeightRule, get_spec
from .costs import _cache, _Costs, _e, _LinkFn
from .dp_memory import _rank_tensors, _stage_params, dp_costs, memory_per_rank  # noqa: F401
from .ends import _ends
from .grad_accumulation import MODES, accumulation_s
from .training import StepTime, Training
from .pipeline_time import busy_bound, chain_bound, pipeline_time
from .profile import Profile
from .split_backward_cost import w_reentry_s
from .step_breakdown import CriticalSync, PipelineRun, StageCosts, step_time
from .transformer_layer import layer_costs

# ---------------------------------------------------------------------------------------
# the step
# ---------------------------------------------------------------------------------------

def _validate(shape, trn: Training) -> None:
    """The layout's rules (``Layout.check_model``, stated once) and the dtype."""
    lay, opt = trn.layout, trn.options
    lay.check_model(shape, sp=opt.tensor.sp)
    _e(trn.dtype)
    if trn.grad_accumulation not in MODES:
        raise ConfigError(f"grad_accumulation={trn.grad_accumulation!r} must be one of "
                          f"{', '.join(MODES)} (how a micro-batch's weight gradient reaches "
                          "the gradient buffer)")


def predict_step(shape, training: Training, profile: Profile, bound: bool = False) -> StepTime:
    """The predicted step time of ``training`` for model ``shape`` on ``profile``'s devices
    (module doc for every rule). ``shape``: a :class:`parbench.analytic.shape.Shape` (or any
    object ``shape_from`` reads).

    ``bound=True``: a lower bound of the step, priced without simulating the schedule (the
    pipeline's makespan replaced by the busiest rank's busy time; the rest unchanged); the
    planner ranks by it first and simulates only what could make its top list."""
    if not isinstance(shape, Shape):
        shape = shape_from(shape)
    trn = training
    _validate(shape, trn)
    key = ("step", shape, trn, bound)
    cache = _cache(profile)
    hit = cache.get(key)
    if hit is not None:
        return hit
    st = _predict(shape, trn, profile, bound)
    if len(cache) > 200000:
        cache.clear()
    cache[key] = st
    return st


@lru_cache(maxsize=256)
def _moe_layers(shape) -> frozenset:
    return frozenset(i for i in range(shape.l) if shape.is_moe_layer(i)) if shape.moe \
        else frozenset()


def _predict(shape, trn: Training, profile: Profile, bound: bool = False) -> StepTime:
    """One step of ``trn`` priced (module doc): each virtual stage's costs, the pipeline,
    the optimizer and data-parallel sync on the critical rank, then the StepTime."""
    lay = trn.layout
    if lay.uneven and not get_spec(lay.schedule).takes_uneven_stages:
        raise ValueError(f"schedule={lay.schedule!r} places other stages on the first and "
                         "last pipeline ranks: first_stage_layers / last_stage_layers need a "
                         "linear or looped (interleaved) schedule")
    stages = _stage_costs(shape, trn, profile)
    pipe = _pipeline(shape, trn, profile, stages.per_stage, bound)
    sync = _critical_sync(shape, trn, profile, stages.per_stage, pipe)
    return step_time(shape, trn, profile, stages, pipe, sync)


def priced_pipeline(shape, trn: Training, profile: Profile, bound: bool = False,
                    bubble: bool = True, stages: StageCosts | None = None):
    """(stage costs, pipeline run) of ``trn``, as ``predict_step`` prices them before the
    critical rank's sync: the same for layouts that differ in the ZeRO stage alone (but
    PipeDream's per-micro-batch updates, which read it), so the planner prices them once
    for all of them (:func:`step_seconds`). ``stages``: the stage costs of the same grid,
    micro-batch size, vpp and options, copied (the schedule adds to its own copy);
    ``bubble=False``: the makespan without p2p latency is not simulated (only the
    bubble and the exposed pp time read it)."""
    if stages is None:
        stages = _stage_costs(shape, trn, profile)
    elif trn.layout.pp > 1 and _schedule_adds(profile, get_spec(trn.layout.schedule)):
        stages = StageCosts(stages.layer, stages.emb, stages.head,
                            [c.copy() for c in stages.per_stage])
    return stages, _pipeline(shape, trn, profile, stages.per_stage, bound, bubble)


def step_seconds(shape, trn: Training, profile: Profile, stages: StageCosts,
                 pipe: PipelineRun) -> float:
    """``predict_step(...).step_s`` from :func:`priced_pipeline`'s parts: the makespan, the
    critical rank's data-parallel sync, optimizer step and loss all-reduce (the same sum)."""
    sync = _critical_sync(shape, trn, profile, stages.per_stage, pipe)
    return pipe.makespan + sync.dp_exposed + sync.opt_s + sync.loss_s


def _stage_costs(shape, trn: Training, profile: Profile) -> StageCosts:
    """Each virtual stage's cost of one micro-batch: its dense and MoE layers, the embedding
    on the first stage, the LM head on the last."""
    lay = trn.layout
    chunks = lay.chunk_layers(shape.l)
    nstages = len(chunks)
    moe_idx = _moe_layers(shape)
    dense_c = layer_costs(shape, trn, profile, False)
    moe_c = layer_costs(shape, trn, profile, True) if moe_idx else None
    emb, head = _ends(shape, trn, profile)
    stage_costs: list[_Costs] = []
    made: dict = {}  # stages alike (their MoE layers, ends) share one sum, copied
    lo = 0
    for vs, n in enumerate(chunks):
        n_moe = sum(1 for i in range(lo, lo + n) if i in moe_idx) if moe_idx else 0
        lo += n
        key = (n, n_moe, vs == 0, vs == nstages - 1)
        proto = made.get(key)
        if proto is None:
            proto = made[key] = _Costs()
            proto.add(dense_c, n - n_moe)
            if n_moe:
                proto.add(moe_c, n_moe)
            if vs == 0:
                proto.add(emb)
            if vs == nstages - 1:
                proto.add(head)
            proto.w += accumulation_s(shape, trn, profile, n - n_moe, n_moe, vs == 0,
                                      vs == nstages - 1)
        stage_costs.append(proto.copy())
    return StageCosts(dense_c, emb, head, stage_costs)


def _pipeline(shape, trn: Training, profile: Profile, stage_costs: list[_Costs],
              bound: bool, bubble: bool = True) -> PipelineRun:
    """The schedule run with the stage costs (one stage: m micro-batches back to back);
    ``bound``: the busiest rank's busy time instead of the simulated makespan; ``bubble``:
    also the makespan without p2p latency (else the makespan stands in for it)."""
    lay = trn.layout
    p, m = lay.pp, lay.num_microbatches
    if p == 1:
        c = stage_costs[0]
        busy = m * (c.tf + c.tb + c.w)
        return PipelineRun(None, WeightRule.SYNC, busy, busy, [busy], 0.0)
    # the schedule's facts (split backward, weight rule, placement): its spec
    spec = get_spec(lay.schedule)
    p2p = _p2p_time(shape, trn, profile)
    _add_schedule_costs(shape, trn, profile, stage_costs, spec, p2p)
    if bound:
        # no bound for the V and two-pipe placements: 0, still a lower bound
        busy_ranks = busy_bound(trn, stage_costs) or [0.0] * p
        makespan = makespan0 = chain_bound(trn, stage_costs, busy_ranks)
    else:
        # the latency of each cross-rank dependency (in the simulator)
        makespan, makespan0, busy_ranks = _simulated(shape, trn, profile, stage_costs, p2p,
                                                     bubble)
    return PipelineRun(spec, spec.weight_rule, makespan, makespan0, busy_ranks, p2p)


def _p2p_time(shape, trn: Training, profile: Profile) -> float:
    """Seconds of one stage-to-stage send of a micro-batch's activations (1/tp of them
    under sequence parallelism), on the link between pipeline neighbours."""
    lay = trn.layout
    s_p2p = lay.micro_batch_size * (shape.s // lay.cp) * shape.h * _e(trn.dtype)
    if trn.options.tensor.sp and lay.tp > 1:
        s_p2p //= lay.tp
    link = _LinkFn(profile, trn.ranks_per_node or profile.ranks_per_node)(
        lay.tp * lay.cp * lay.dp, 2)
    return profile.collective_time("send", 2, s_p2p, link)


def _schedule_adds(profile: Profile, spec: ScheduleSpec) -> bool:
    """Whether :func:`_add_schedule_costs` changes the stage costs (each of its cases)."""
    return bool(profile.p2p_blocking or spec.splits_backward
                or spec.weight_rule is WeightRule.PIPEDREAM)


def _add_schedule_costs(shape, trn: Training, profile: Profile, stage_costs: list[_Costs],
                        spec: ScheduleSpec, p2p: float) -> None:
    """What the schedule adds to each virtual stage's costs: blocking sends, a split
    backward's engine calls, PipeDream's per-micro-batch weight updates (the cases of
    :func:`_schedule_adds`)."""
    nstages = len(stage_costs)
    chunks = trn.layout.chunk_layers(shape.l)
    if profile.p2p_blocking:
        # a blocking send (rendezvous) keeps the sender busy until its receive is posted:
        # each virtual stage but the last sends its activations after F, each but the first
        # its gradient after B. The simulator does not model the rendezvous's wait for a
        # busy receiver.
        for vs, c in enumerate(stage_costs):
            if vs < nstages - 1:
                c.comm_f["pp"] = c.comm_f.get("pp", 0.0) + p2p
            if vs > 0:
                c.comm_b["pp"] = c.comm_b.get("pp", 0.0) + p2p
    if spec.splits_backward:
        # a split backward's W (Qi et al. 2024, Sec. 2) re-enters the autograd graph once
        # per weight node, each re-entry walking the graph below it (split_backward_cost)
        for vs, c in enumerate(stage_costs):
            c.w += w_reentry_s(profile, shape, trn.layout.tp, chunks[vs], vs == 0,
                               vs == nstages - 1)
    if spec.weight_rule is WeightRule.PIPEDREAM:
        # PipeDream (Narayanan et al. 2019, Sec. 3.3): each stage applies an optimizer
        # step after every micro-batch's backward and stashes the new weight version
        for vs, c in enumerate(stage_costs):
            psi_s, n_t, opt_vs = _optimizer_time(shape, trn, profile, vs)
            c.b += opt_vs + _version_copy(profile, psi_s, n_t)


def _critical_sync(shape, trn: Training, profile: Profile, stage_costs: list[_Costs],
                   pipe: PipelineRun) -> CriticalSync:
    """The busiest rank's totals (the stages the schedule's placement gives it), then its
    optimizer step, data-parallel sync and the loss all-reduce."""
    lay = trn.layout
    p, v, m = lay.pp, lay.vpp, lay.num_microbatches
    rank_costs = [_Costs() for _ in range(p)]
    for vs, r, share in _held_stages(pipe.spec, p, v, p * v):
        rank_costs[r].add(stage_costs[vs], m * share)
    busy_ranks = pipe.busy_ranks
    crit = max(range(p), key=lambda r: busy_ranks[r] if r < len(busy_ranks) else 0.0)
    rc0 = rank_costs[crit]
    psi, tensors, opt_s = _optimizer_time(shape, trn, profile, crit)
    if pipe.rule is WeightRule.PIPEDREAM:
        opt_s = 0.0  # every micro-batch's update is inside the pipeline (_add_schedule_costs)
    elif pipe.rule is WeightRule.TWO_BW:
        opt_s += _version_copy(profile, psi, tensors)
    bwd_each = rc0.b + rc0.w
    bwd_each /= max(m, 1)
    fwd_each = rc0.f / max(m, 1)
    dp_exposed, dp_total, dp_detail = dp_costs(shape, trn, profile, crit, psi,
                                               bwd_each, bwd_each, fwd_each, tensors)
    return CriticalSync(crit, rc0, opt_s, dp_exposed, dp_total, dp_detail,
                         _loss_allreduce_time(trn, profile))


def _loss_allreduce_time(trn: Training, profile: Profile) -> float:
    """The step's loss, averaged over the ranks that hold replicas of it (every scheme
    reports the global mean, as Megatron averages the loss over data parallelism)."""
    lay = trn.layout
    n_loss = lay.dp * lay.cp * lay.pp
    if n_loss > 1:
        stride = lay.tp if lay.pp == 1 else lay.tp * lay.cp * lay.dp
        link = _LinkFn(profile, trn.ranks_per_node or profile.ranks_per_node)(
            lay.tp, n_loss if lay.pp == 1 else stride * lay.pp // max(lay.tp, 1))
        return profile.collective_time("all_reduce", n_loss, 8, link)
    if lay.tp > 1:
        return profile.collective_time("all_reduce", lay.tp, 8, "intra")
    return 0.0




def _held_stages(spec, p: int, v: int, nstages: int) -> list[tuple[int, int, float]]:
    """``(stage, rank, share of the m micro-batches)`` for every stage the schedule's
    placement holds (two replicas: each takes half); stage s on rank s % p without a
    schedule or when the stage count does not fit its placement."""
    if spec is None or spec.placement.num_stages(p, v) != nstages:
        return [(vs, vs % p, 1.0) for vs in range(nstages)]
    pipes = spec.placement.pipes
    return [(stage, rank, 1.0 / pipes)
            for (_, stage), rank in spec.placement.ranks(p, v).items()]


def _optimizer_time(shape, trn: Training, profile: Profile, rank: int
                    ) -> tuple[float, int, float]:
    """(parameters, parameter tensors, seconds of one optimizer step) of pipeline ``rank``:
    AdamW per tensor and per element of the rank's shard (ZeRO >= 1 steps 1/(dp cp) of it,
    in a few flat buffers); on a preset, the bytes per element over the memory bandwidth,
    with a 16-bit run's mixed-precision passes (``mixed_bytes_<dtype>``: the gradient cast
    to fp32, its norm, the master weight copied back, fp16's unscale; ``devices``)."""
    lay, opt = trn.layout, trn.options
    psi = float(_stage_params(shape, trn)[rank]["total"])
    tkey = ("ntensors", shape, lay.tp, lay.pp, lay.vpp, lay.first_stage_layers,
            lay.last_stage_layers, rank)
    pcache = _cache(profile)
    tensors = pcache.get(tkey)
    if tensors is None:
        tensors = pcache[tkey] = len(_rank_tensors(shape, trn, rank)) if not shape.moe else \
            int(12 * lay.stage_layers(shape.l)[rank] + 5)
    n_dp = lay.dp * lay.cp
    shard = psi / n_dp if (opt.data.zero_stage >= 1 and n_dp > 1) else psi
    opt_tensors = tensors if (opt.data.zero_stage == 0 or n_dp == 1) else max(1, tensors // 6)
    per_el = profile.optimizer.get("per_element_s")
    if per_el is None:
        nbytes = profile.optimizer.get("bytes_per_element", 32.0) + \
            profile.optimizer.get(f"mixed_bytes_{trn.dtype}", 0.0)
        per_el = nbytes / (profile.mem_bandwidth or 1e11)
    opt_s = opt_tensors * profile.optimizer.get("per_tensor_s", 0.0) + shard * per_el
    if trn.optimizer == "sgd":
        opt_s *= 0.4
    return psi, tensors, opt_s


def _version_copy(profile: Profile, psi: float, tensors: int) -> float:
    """One new weight version of a stage written into its copy (PipeDream's stash, 2BW's
    second buffer): every fp32 parameter tensor read and written once."""
    return profile.mem_time(2 * 4 * psi, tensors)


def _simulated(shape, trn: Training, profile: Profile, stage_costs, p2p_s: float,
               bubble: bool = True):
    """``pipeline_time``, with a schedule the simulator refuses named in the error."""
    lay = trn.layout
    try:
        return pipeline_time(shape, trn, profile, stage_costs, p2p_s, bubble)
    except Exception as exc:  # noqa: BLE001 - a schedule the simulator refuses
        raise ValueError(f"schedule={lay.schedule!r} with pp={lay.pp}, vpp={lay.vpp}, "
                         f"num_microbatches={lay.num_microbatches}: {exc}") from None

