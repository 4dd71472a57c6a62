"""The time model: one training step of a layout on a device profile, priced op by op.

``predict_step(shape, layout, profile) -> StepTime``. The rules, each with its source:

**Compute** (per rank, per micro-batch, per layer). The reference layer's operators at the
rank's local shapes -- T = b s/cp tokens, heads a/tp, widths f/tp and (h + 2 h_kv)/tp: the four
linears' GEMMs forward, and backward the input-gradient GEMM (B) and the weight-gradient GEMM
(W) of each (Narayanan et al. 2021 App.: backward = 2 x forward), priced by
:meth:`Profile.gemm_time` (measured at these shapes after ``calibrate model=...``, else the
measured rate interpolated in FLOPs, else the peak); the fused attention kernel forward and
backward (:meth:`Profile.attention_time`); the memory-bound operators (two LayerNorms, two
residual adds, the activation, bias gradients, gradient accumulation) as bytes over the memory
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
import math

from .costs import _cache, _Costs, _e, layer_costs, _LinkFn
from .dp_memory import dp_costs, memory_per_rank, _rank_tensors, _stage_params
from .ends import _ends
from ..schedules import WeightRule, get_spec
from .layout import StepTime, Training
from .pipeline_time import busy_bound, pipeline_time
from .profile import Profile

# ---------------------------------------------------------------------------------------
# the step
# ---------------------------------------------------------------------------------------

def _validate(shape, trn: Training) -> None:
    """The layout's rules (``Layout.check_model``, stated once) and the dtype."""
    lay, opt = trn.layout, trn.options
    lay.check_model(shape, sp=opt.tensor.sp)
    _e(trn.dtype)


def predict_step(shape, training: Training, profile: Profile, bound: bool = False) -> StepTime:
    """The predicted step time of ``training`` for model ``shape`` on ``profile``'s devices
    (module doc for every rule). ``shape``: a :class:`parbench.analytic.shape.Shape` (or any
    object ``shape_from`` reads).

    ``bound=True``: a lower bound of the step, priced without simulating the schedule (the
    pipeline's makespan replaced by the busiest rank's busy time; the rest unchanged); the
    planner ranks by it first and simulates only what could make its top list."""
    from ..analytic.shape import Shape, shape_from
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
    lay, opt = trn.layout, trn.options
    from ..analytic import flops as aflops
    notes: list[str] = []
    p, v, m = lay.pp, lay.vpp, lay.num_microbatches
    e = _e(trn.dtype)
    nstages = p * v
    per_chunk = shape.l // nstages
    # ---- per virtual stage costs of one micro-batch
    moe_idx = _moe_layers(shape)
    dense_c = layer_costs(shape, trn, profile, False)
    moe_c = layer_costs(shape, trn, profile, True) if moe_idx else None
    emb, head = _ends(shape, trn, profile)
    stage_costs: list[_Costs] = []
    for vs in range(nstages):
        c = _Costs()
        lo = vs * per_chunk
        n_moe = sum(1 for i in range(lo, lo + per_chunk) if i in moe_idx)
        c.add(dense_c, per_chunk - n_moe)
        if n_moe:
            c.add(moe_c, n_moe)
        if vs == 0:
            c.add(emb)
        if vs == nstages - 1:
            c.add(head)
        stage_costs.append(c)
    # micro-batch-level fixed costs (loss scaling, backward() call) on the last stage
    # ---- data-parallel exposure inside the pipeline (ZeRO-2/3 per micro-batch)
    # ---- pipeline
    spec, rule = None, WeightRule.SYNC  # one stage: no schedule runs
    if p == 1:
        c = stage_costs[0]
        busy = m * (c.tf + c.tb + c.w)
        makespan = makespan0 = busy
        busy_ranks = [busy]
        p2p = 0.0
    else:
        # the schedule's facts (split backward, weight rule, placement): its spec
        spec = get_spec(lay.schedule)
        rule = spec.weight_rule
        s_p2p = lay.micro_batch_size * (shape.s // lay.cp) * shape.h * e
        if opt.tensor.sp and lay.tp > 1:
            s_p2p //= lay.tp
        link = _LinkFn(profile, trn.ranks_per_node or profile.ranks_per_node)(
            lay.tp * lay.cp * lay.dp, 2)
        p2p = profile.collective_time("send", 2, s_p2p, link)
        # the latency of each cross-rank dependency (in the simulator); a blocking send
        # (rendezvous) also keeps the sender busy until its receive is posted: each virtual
        # stage but the last sends its activations after F, each but the first its gradient
        # after B. The simulator does not model the rendezvous's wait for a busy receiver.
        p2p_latency = p2p
        if profile.p2p_blocking:
            for vs, c in enumerate(stage_costs):
                if vs < nstages - 1:
                    c.comm_f["pp"] = c.comm_f.get("pp", 0.0) + p2p
                if vs > 0:
                    c.comm_b["pp"] = c.comm_b.get("pp", 0.0) + p2p
        if spec.splits_backward:
            # a split backward's W (Qi et al. 2024, Sec. 2) re-enters the autograd graph once
            # per linear layer (4 per transformer layer, the LM head on the last stage): one
            # engine call each, beside B's own (``impls/pipeline/split_backward.py``)
            for vs, c in enumerate(stage_costs):
                calls = 4 * per_chunk + (1 if vs == nstages - 1 else 0)
                c.w += calls * profile.backward_call_s
        if rule is WeightRule.PIPEDREAM:
            # PipeDream (Narayanan et al. 2019, Sec. 3.3): each stage applies an optimizer
            # step after every micro-batch's backward and stashes the new weight version
            for vs, c in enumerate(stage_costs):
                psi_s, n_t, opt_vs = _optimizer_time(shape, trn, profile, vs)
                c.b += opt_vs + _version_copy(profile, psi_s, n_t)
        if bound:
            # no bound for the V and two-pipe placements: 0, still a lower bound
            busy_ranks = busy_bound(trn, stage_costs) or [0.0] * p
            makespan = makespan0 = max(busy_ranks)
        else:
            makespan, makespan0, busy_ranks = _simulated(shape, trn, profile, stage_costs,
                                                         p2p_latency)
    # ---- per rank totals (the stages the schedule's placement gives each rank)
    rank_costs = [_Costs() for _ in range(p)]
    for vs, r, share in _held_stages(spec, p, v, nstages):
        rank_costs[r].add(stage_costs[vs], m * share)
    crit = max(range(p), key=lambda r: busy_ranks[r] if r < len(busy_ranks) else 0.0)
    rc0 = rank_costs[crit]
    # ---- optimizer and data parallelism, on the critical rank's stage
    n_dp = lay.dp * lay.cp
    psi, tensors, opt_s = _optimizer_time(shape, trn, profile, crit)
    if rule is WeightRule.PIPEDREAM:
        opt_s = 0.0  # every micro-batch's update is inside the pipeline (above)
    elif rule is WeightRule.TWO_BW:
        opt_s += _version_copy(profile, psi, tensors)
    bwd_each = rc0.b + rc0.w
    bwd_each /= max(m, 1)
    fwd_each = rc0.f / max(m, 1)
    dp_exposed, dp_total, dp_detail = dp_costs(shape, trn, profile, crit, psi,
                                               bwd_each, bwd_each, fwd_each, tensors)
    # the step's loss, averaged over the ranks that hold replicas of it (every scheme
    # reports the global mean, as Megatron averages the loss over data parallelism)
    n_loss = lay.dp * lay.cp * lay.pp
    loss_s = 0.0
    if n_loss > 1:
        stride = lay.tp if lay.pp == 1 else lay.tp * lay.cp * lay.dp
        link = _LinkFn(profile, trn.ranks_per_node or profile.ranks_per_node)(
            lay.tp, n_loss if lay.pp == 1 else stride * lay.pp // max(lay.tp, 1))
        loss_s = profile.collective_time("all_reduce", n_loss, 8, link)
    elif lay.tp > 1:
        loss_s = profile.collective_time("all_reduce", lay.tp, 8, "intra")
    step = makespan + dp_exposed + opt_s + loss_s
    # ---- breakdown
    compute = rc0.f + rc0.b + rc0.w + opt_s
    recompute = rc0.rc
    exposed = {ax: v_ for ax, v_ in ((ax, rc0.comm_f.get(ax, 0.0) + rc0.comm_b.get(ax, 0.0))
                                     for ax in ("tp", "cp", "ep", "pp")) if v_ > 0}
    if p > 1:
        exposed["pp"] = exposed.get("pp", 0.0) + max(makespan - makespan0, 0.0)
    if n_dp > 1:
        exposed["dp"] = dp_exposed
    if loss_s:
        ax = "dp" if n_dp > 1 else ("pp" if p > 1 else "tp")
        exposed[ax] = exposed.get(ax, 0.0) + loss_s
    busy_crit = busy_ranks[crit] if p > 1 else makespan
    bubble = max(makespan0 - busy_crit, 0.0) if p > 1 else 0.0
    heaviest = max(exposed, key=exposed.get) if any(x > 0 for x in exposed.values()) \
        else None
    # ---- throughput, MFU
    B = lay.micro_batch_size * m * lay.dp  # noqa: N806
    tokens = B * shape.s
    model_flops = aflops.shape_training_flops(shape, B, recompute=False)
    world = lay.world_size
    peak = profile.peak_flops(trn.dtype)
    mfu = model_flops / (step * world * peak) if step > 0 else 0.0
    # ---- memory
    mem, mem_detail = memory_per_rank(shape, trn)
    dev = profile.memory_bytes or math.inf
    fits = mem <= dev
    if not fits:
        notes.append(f"over memory: {mem / 1e9:.1f} GB per rank > {dev / 1e9:.1f} GB of "
                     f"{profile.name}")
    if not profile.calibrated:
        notes.append(f"{profile.name} is an uncalibrated preset (datasheet peaks): step "
                     "time is a lower bound, MFU an upper bound")
    if shape.moe:
        notes.append("MoE: experts assumed balanced (k T rows per rank); routing and "
                     "dispatch costs approximate")
    breakdown = {
        "per_microbatch": {
            "layer": {"fwd_s": dense_c.f, "bwd_input_s": dense_c.b, "bwd_weight_s": dense_c.w,
                      "recompute_s": dense_c.rc, "comm_fwd_s": dict(dense_c.comm_f),
                      "comm_bwd_s": dict(dense_c.comm_b)},
            "embedding": {"fwd_s": emb.f, "bwd_s": emb.b + emb.w,
                          "comm_s": sum(emb.comm_f.values()) + sum(emb.comm_b.values())},
            "head": {"fwd_s": head.f, "bwd_s": head.b + head.w,
                     "comm_s": sum(head.comm_f.values()) + sum(head.comm_b.values())},
            "stages": [{"tf_s": c.tf, "tb_s": c.tb, "tw_s": c.w} for c in stage_costs],
        },
        "critical_rank": crit,
        "pipeline_s": makespan,
        "p2p_s": p2p,
        "optimizer_s": opt_s,
        "loss_allreduce_s": loss_s,
        "dp": {"exposed_s": dp_exposed, "total_s": dp_total, **dp_detail},
        "overlap_fraction": profile.overlap,
        "model_flops": model_flops,
        "tokens_per_step": tokens,
        "peak_flops": peak,
        "memory": mem_detail,
        "profile": profile.name,
    }
    return StepTime(step_s=step, tokens_per_s=tokens / step if step > 0 else 0.0, mfu=mfu,
                    compute_s=compute, recompute_s=recompute, bubble_s=bubble,
                    exposed_comm_s=exposed, memory_per_rank_bytes=mem,
                    device_memory_bytes=profile.memory_bytes, fits=fits,
                    heaviest_axis=heaviest, notes=notes, breakdown=breakdown)


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
    in a few flat buffers)."""
    lay, opt = trn.layout, trn.options
    psi = float(_stage_params(shape, trn)[rank]["total"])
    tkey = ("ntensors", shape, lay.tp, lay.pp, lay.vpp, rank)
    pcache = _cache(profile)
    tensors = pcache.get(tkey)
    if tensors is None:
        tensors = pcache[tkey] = len(_rank_tensors(shape, trn, rank)) if not shape.moe else \
            int(12 * shape.l / lay.pp + 5)
    n_dp = lay.dp * lay.cp
    shard = psi / n_dp if (opt.data.zero_stage >= 1 and n_dp > 1) else psi
    opt_tensors = tensors if (opt.data.zero_stage == 0 or n_dp == 1) else max(1, tensors // 6)
    per_el = profile.optimizer.get("per_element_s")
    if per_el is None:
        per_el = profile.optimizer.get("bytes_per_element", 32.0) / (profile.mem_bandwidth
                                                                      or 1e11)
    opt_s = opt_tensors * profile.optimizer.get("per_tensor_s", 0.0) + shard * per_el
    if trn.optimizer == "sgd":
        opt_s *= 0.4
    return psi, tensors, opt_s


def _version_copy(profile: Profile, psi: float, tensors: int) -> float:
    """One new weight version of a stage written into its copy (PipeDream's stash, 2BW's
    second buffer): every fp32 parameter tensor read and written once."""
    return profile.mem_time(2 * 4 * psi, tensors)


def _simulated(shape, trn: Training, profile: Profile, stage_costs, p2p_s: float):
    """``pipeline_time``, with a schedule the simulator refuses named in the error."""
    lay = trn.layout
    try:
        return pipeline_time(shape, trn, profile, stage_costs, p2p_s)
    except Exception as exc:  # noqa: BLE001 - a schedule the simulator refuses
        raise ValueError(f"schedule={lay.schedule!r} with pp={lay.pp}, vpp={lay.vpp}, "
                         f"num_microbatches={lay.num_microbatches}: {exc}") from None

