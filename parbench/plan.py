"""The planner: every parallel layout of a model on N devices, pruned by the divisibility rules
and by memory, ranked by the time model's predicted step time (``parbench plan``).

The search space, per layout (Narayanan et al. 2021 Sec. 3 give the rules of PTD-P; cp and ep
as Megatron-Core lays them out):

- the degrees pass every rule of ``parbench.layout`` (``Layout.fits_model``, stated once
  there): tp divides the heads, the K/V heads (or they divide tp), the MLP and, with
  sequence parallelism (on whenever tp > 1), the rank's s / cp tokens; 2 cp divides the
  sequence (the load-balanced split); ep divides the experts and cp dp (expert-tp = tp,
  Megatron-Core's default); pp divides the layers, or (``Space.uneven``) the layers besides
  two lighter end ranks split evenly over the others; dp = N / (tp cp pp). With ``max_tp``,
  tp stays within a node's devices (Megatron keeps tensor parallelism inside the NVLink
  domain);
- vpp (interleaved 1F1B) divides the layers per stage, and m passes the schedule's rules
  (``ScheduleSpec.refusal``; interleaved: m a multiple of max(1, m // pp));
- micro-batch size b divides the global batch per dp rank, m = B / (dp b); pipelines need
  m >= pp;
- schedule: 1F1B, GPipe, ZB-H1 and ZB-H2 with one stage per rank, interleaved 1F1B with
  vpp > 1, ZB-V, DualPipeV, V-Half and V-Min with two chunks per rank (pp = 1: no
  schedule); any registered schedule can be asked for (``Space.schedules``), each searched
  through its spec (``parbench.schedules.ScheduleSpec``) unless the spec says why the time
  model cannot price it;
- ZeRO stage 0-3, recompute none / selective / full.

Every layout's memory is counted first, as ``parbench estimate`` counts it
(``timemodel.memory_per_rank`` = ``analytic.rank_memory``: the accounting and attention of
``base``, MoE layers as MoE); those that do not fit in the device's memory are dropped before
any pricing, the rest are priced by ``parbench.timemodel.predict_step`` and ranked by step
time (ties in the order :func:`layouts` yields them).

The search (``plan_search``) is exact: its top list is the exhaustive one's (``exhaustive=
True`` simulates every layout that fits; tests compare the two, dense and MoE). What it
prunes, and why that keeps the result:

- *memory, by group*: the layouts of one grid at one micro-batch size (a group) are counted
  together -- the per-rank model states (per grid, vpp and ZeRO stage) and activations (per
  grid, vpp, b and recomputation) are ``rank_memory``'s own cached pieces, summed with the
  same float operations, so every layout's fit is ``memory_per_rank``'s, to the bit;
- *whole groups and pipes, by a bound*: best first, every entry keyed by a lower bound of
  every layout below it -- a group by the loss all-reduce plus the least mean busy time of
  its ranks over its recomputations and algorithms (every schedule runs each stage m times
  in all, and what a schedule adds to the stages only adds; the dp sync and the optimizer
  are >= 0); a *pipe* (schedule, vpp, recomputation, algorithm) by the very makespan bound
  of ``predict_step(..., bound=True)`` plus the loss; a layout by its
  ``predict_step(..., bound=True)`` (the busiest rank's busy time, the fill and drain chain,
  for the makespan). The search stops when the smallest key, times ``BOUND_SLACK``, exceeds
  the k-th best simulated step: as before, a layout is simulated only if its own bound could
  still make the top list, and no layout is skipped that the layout-by-layout search would
  have simulated, since its group's and pipe's keys are at most its bound;
- *shared pricing*: stage costs once per (grid, b, vpp, recomputation, algorithm), the
  pipeline once per pipe for all its ZeRO stages (``timemodel.model.priced_pipeline`` and
  ``step_seconds``: ``predict_step``'s own code and sums), a full ``StepTime`` only for the
  top list. ``PlanResult`` counts what was done (considered, over memory, bounded,
  simulated, skipped).
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from typing import Callable

from .layout import ConfigError, Layout
from .plan_search import Group, Counts, cap_of, fits_mask, fitting, search
from .schedules import ChunkRule, get_spec
from .timemodel import Training, memory_per_rank, predict_step


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class Space:
    """What the planner may choose (defaults: everything the rules allow)."""

    max_tp: int = 8
    max_cp: int = 8
    micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    schedules: tuple[str, ...] = ("1f1b", "gpipe", "zb-h1", "zb-h2", "interleaved", "zbv",
                                  "dualpipev", "vhalf", "vmin")
    vpps: tuple[int, ...] = (2, 3, 4)
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    recomputes: tuple[str, ...] = ("none", "selective", "full")
    #: the context-parallel attention algorithms searched where cp > 1
    cp_algorithms: tuple[str, ...] = ("ring-attention", "ulysses", "allgather")
    #: expert tensor-parallel sizes searched for MoE models: 0 = tp (Megatron-Core's
    #: default), 1 = experts whole on each rank (``--expert-tensor-parallel-size 1``)
    etps: tuple[int, ...] = (0, 1)
    #: where pp does not divide the layers, also search the split with lighter end ranks
    #: (``_lighter_ends``; Megatron's ``--decoder-first/last-pipeline-num-layers``)
    uneven: bool = True


@dataclass
class PlanResult:
    """The ranked layouts that fit, and what the search saw: ``evaluated`` layouts the
    rules accept (every one counted against memory), ``over_memory`` of them over the
    device's memory; of those that fit, ``bounded`` had their lower bound priced,
    ``simulated`` were priced exactly (the schedule simulated), ``skipped`` were never
    priced because their group's bound could not beat the k-th best."""

    ranked: list  # (Training, StepTime), fastest first
    evaluated: int
    over_memory: int
    seconds: float
    #: the fastest that did not fit -- priced only when none fits (what memory cost)
    best_over_memory: list = field(default_factory=list)
    bounded: int = 0
    simulated: int = 0
    skipped: int = 0


def layouts(shape, world: int, global_batch: int, space: Space = Space(),
            base: Training | None = None):
    """Every way to train ``shape`` on ``world`` devices that the layout rules accept (a
    generator of ``timemodel.Training``): the degrees pass ``Layout.fits_model`` with
    sequence parallelism on when tp > 1, then every micro-batch size, schedule, ZeRO stage
    and recomputation of :func:`_per_degrees`. ``base``: what every candidate shares --
    precision, optimizer, the memory accounting and attention (default ``Training()``)."""
    for lay in _grids(shape, world, global_batch, space):
        yield from _per_degrees(shape, lay, global_batch, space, base or Training())


def _grids(shape, world: int, global_batch: int, space: Space):
    """The degrees (tp, cp, ep, etp, dp, pp) of every layout the rules accept."""
    for tp in divisors(world):
        if tp > space.max_tp:
            continue
        for cp in divisors(world // tp):
            if cp > space.max_cp:
                continue
            for pp in divisors(world // (tp * cp)):
                dp = world // (tp * cp * pp)
                if global_batch % dp:
                    continue
                ends = _lighter_ends(shape.l, pp) if space.uneven else (0, 0)
                for ep, etp in _expert_degrees(shape, tp, tp * cp * dp, space):
                    lay = Layout(tp=tp, cp=cp, ep=ep, etp=etp, dp=dp, pp=pp,
                                 micro_batch_size=1, first_stage_layers=ends[0],
                                 last_stage_layers=ends[1])
                    if lay.fits_model(shape, sp=tp > 1, cp_balance="zigzag"):
                        yield lay


def _lighter_ends(num_layers: int, pp: int) -> tuple[int, int]:
    """(first, last) layers of the pipeline's end ranks where pp does not divide the layers:
    both ends the same number, as many as leaves the middle ranks an even split with at
    least one layer more each (the end ranks also hold the embedding and the LM head; Llama
    3 405B: 126 layers on 16 stages as 7 + 14 x 8 + 7, Llama Team 2024, Sec. 3.3.2);
    (0, 0): an even split, or none such."""
    if pp < 3 or num_layers % pp == 0:
        return 0, 0
    for x in range(num_layers // pp, 0, -1):
        rest = num_layers - 2 * x
        if rest > 0 and rest % (pp - 2) == 0 and rest // (pp - 2) > x:
            return x, x
    return 0, 0


def _expert_degrees(shape, tp: int, stage: int, space: Space):
    """(ep, etp) of a stage of ``stage`` ranks: every ep dividing the experts and every etp
    of the space (0 = tp; 1 searched only where it differs) with etp ep dividing the stage
    (Megatron-Core's expert grid etp x ep x edp = tp x cp x dp); (1, 0) for a dense model."""
    if not shape.num_experts:
        yield 1, 0
        return
    for ep in divisors(shape.num_experts):
        for etp in space.etps:
            if etp and (etp >= tp or tp % etp):
                continue  # etp = tp is the 0 already searched; etp must divide tp
            if stage % ((etp or tp) * ep) == 0:
                yield ep, etp


def _per_degrees(shape, grid: Layout, global_batch: int, space: Space, base: Training):
    """Every micro-batch size, schedule, ZeRO stage, recomputation and context-parallel
    algorithm on one grid (the members of its :func:`_groups`, in their order)."""
    for group in _groups(shape, grid, global_batch, space, base):
        for si in range(len(group.scheds)):
            for oi in range(len(group.options)):
                yield group.member(si, oi)


def _groups(shape, grid: Layout, global_batch: int, space: Space, base: Training):
    """The grid at each micro-batch size b the batch allows (m = B / (dp b), pipelines need
    m >= pp): a ``plan_search.Group`` of every (schedule, vpp) times every option set."""
    base = base.with_values(sp=grid.tp > 1)
    options = [_options(base.options, zero, rc, algo)
               for zero in space.zero_stages if not (zero and grid.dp == 1)
               for rc in space.recomputes  # ZeRO with dp = 1 has nothing to shard over
               for algo in _cp_algorithms(shape, grid, space, base)]
    per_rank = global_batch // grid.dp
    for b in space.micro_batch_sizes:
        if per_rank % b:
            continue
        m = per_rank // b
        if grid.pp > 1 and m < grid.pp:
            continue
        scheds = _schedule_list(tuple(grid.stage_layers(shape.l)), grid.pp, m, space)
        if scheds and options:
            lay = replace(grid, micro_batch_size=b, num_microbatches=m)
            yield Group(0, lay, scheds, base, options)


@lru_cache(maxsize=4096)
def _options(base, zero: int, recompute: str, algorithm: str):
    """``base`` (an ``Options``) with the ZeRO stage, recomputation and context-parallel
    algorithm of one candidate (cached: every grid asks for the same few)."""
    return base.with_values(zero_stage=zero, recompute=recompute, cp_algorithm=algorithm)


def _cp_algorithms(shape, grid: Layout, space: Space, base: Training) -> tuple[str, ...]:
    """The context-parallel algorithms searched on ``grid``: the base's alone without cp;
    else those of the space the model admits -- Ulysses splits each tensor-parallel rank's
    heads (query and key-value) over cp (Jacobs et al. 2023, Sec. 3), so cp divides both."""
    if grid.cp == 1:
        return (base.options.context.cp_algorithm,)
    kv = shape.kv_heads
    heads_ok = (shape.a // grid.tp) % grid.cp == 0 and max(kv // grid.tp, 1) % grid.cp == 0
    return tuple(a for a in space.cp_algorithms if a != "ulysses" or heads_ok)


@lru_cache(maxsize=4096)
def _schedule_list(stage_layers: tuple, pp: int, m: int, space: Space) -> list:
    """:func:`_schedules` as a list, cached (grids of one pp share it)."""
    return list(_schedules(stage_layers, pp, m, space))


def _schedules(stage_layers: list[int], pp: int, m: int, space: Space):
    """Every (schedule, vpp) of the space that its spec accepts on pp ranks with m
    micro-batches (``ScheduleSpec.refusal``: its chunks, fewest micro-batches and further
    rules; never fewer than pp micro-batches) and whose chunks split each rank's layers
    evenly (uneven end ranks: only schedules that place stages linearly or looped); a
    schedule the time model does not price (``ScheduleSpec.unpriced``) is skipped."""
    if pp == 1:
        yield "1f1b", 1
        return
    for name in space.schedules:
        spec = get_spec(name)
        if not spec.priced or m < max(pp, spec.min_microbatches(pp)):
            continue
        if len(set(stage_layers)) > 1 and not spec.takes_uneven_stages:
            continue
        chunks = {ChunkRule.ONE: (1,), ChunkRule.TWO: (2,)}.get(spec.chunks, space.vpps)
        for vpp in chunks:
            if all(n % vpp == 0 for n in stage_layers) and \
                    spec.refusal(pp, m, spec.v_for(vpp)) is None:
                yield name, vpp


def unpriced(space: Space) -> dict[str, str]:
    """The schedules of ``space`` the planner skips, and why (``ScheduleSpec.unpriced``)."""
    return {name: get_spec(name).unpriced for name in space.schedules
            if not get_spec(name).priced}


#: the planner simulates a layout whose lower bound is within this factor of its current
#: k-th best step (the bound is the busiest rank's busy time; the simulator rounds stage
#: costs to 3 significant figures and may pick another critical rank on near ties)
BOUND_SLACK = 0.95


def plan(shape, world: int, profile, global_batch: int, space: Space = Space(),
         predictor: Callable | None = None, keep: int = 10,
         exhaustive: bool = False, base: Training | None = None) -> PlanResult:
    """Price every layout; keep the ``keep`` fastest that fit (and the fastest few that do
    not, to say what memory cost).

    Branch and bound over groups of layouts (module doc, ``plan_search``): layouts are
    simulated in the order of their lower bounds ``predict_step(..., bound=True)`` until the
    next bound -- of a layout, or of a whole group or pipe not yet priced -- exceeds the
    ``keep``-th best simulated step (``BOUND_SLACK``), so the top list is the exhaustive
    search's (``exhaustive=True`` simulates everything: what the tests compare it with). A
    custom ``predictor`` is called once per layout. ``base``: precision, accounting and attention of every candidate
    (:func:`layouts`), so the memory that prunes is ``estimate``'s under the same choices."""
    if world < 1:
        raise ConfigError(f"world={world} must be >= 1")
    if global_batch < 1:
        raise ConfigError(f"global_batch_size={global_batch} must be >= 1")
    t0 = time.perf_counter()
    if predictor is not None:
        exact = lambda trn: predictor(shape, trn, profile)  # noqa: E731
        cands = layouts(shape, world, global_batch, space, base)
        priced = [(st.step_s, trn, st) for trn in cands for st in (exact(trn),)]
        fits = sorted((x for x in priced if x[2].fits), key=lambda x: x[0])[:keep]
        over = sorted((x for x in priced if not x[2].fits), key=lambda x: x[0])[:3]
        n, n_over = len(priced), len(priced) - sum(1 for x in priced if x[2].fits)
        counts = Counts(simulated=n)
    elif exhaustive:
        fitting_, over_mem = _by_memory(shape, layouts(shape, world, global_batch, space,
                                                       base), profile)
        n, n_over = len(fitting_) + len(over_mem), len(over_mem)
        fits = _ranked(shape, fitting_, profile, keep, True)
        over = [] if fits else _ranked(shape, over_mem, profile, 3, True)
        counts = Counts(simulated=len(fitting_))
    else:
        n, n_over, fits, over, counts = _branch_and_bound(shape, world, profile, global_batch,
                                                          space, keep, base)
    return PlanResult(ranked=[(trn, st) for _, trn, st in fits], evaluated=n,
                      over_memory=n_over, seconds=time.perf_counter() - t0,
                      best_over_memory=[(trn, st) for _, trn, st in over],
                      bounded=counts.bounded, simulated=counts.simulated,
                      skipped=counts.skipped)


def plan_groups(shape, world: int, global_batch: int, space: Space = Space(),
                base: Training | None = None) -> list[Group]:
    """The layouts of :func:`layouts` as groups (one grid at one micro-batch size), in
    their order, numbered."""
    groups = [g for grid in _grids(shape, world, global_batch, space)
              for g in _groups(shape, grid, global_batch, space, base or Training())]
    for i, g in enumerate(groups):
        g.order = i
    return groups


def _branch_and_bound(shape, world: int, profile, global_batch: int, space: Space, keep: int,
                      base: Training | None):
    """(layouts, over memory, the ``keep`` fastest that fit, the 3 fastest over memory
    when none fits, Counts): every group's memory counted whole, then the best-first
    search of ``plan_search.search`` (the module doc)."""
    groups = plan_groups(shape, world, global_batch, space, base)
    cap = cap_of(profile)
    memo: dict = {}
    for g in groups:
        g.fits = fits_mask(shape, g, cap, memo)
    n = sum(g.size for g in groups)
    n_fit = fitting(groups)
    best, counts = search(shape, groups, profile, keep, BOUND_SLACK)
    fits = [(step, trn, st) for step, _, trn, st in best]
    over: list = []
    if not fits and n_fit < n:  # what memory cost: the fastest over memory, as before
        over_mem = [g.member(si, oi) for g in groups for si, row in enumerate(g.fits)
                    for oi, ok in enumerate(row) if not ok]
        over = _ranked(shape, over_mem, profile, 3, False)
    return n, n - n_fit, fits, over, counts


def _by_memory(shape, cands, profile) -> tuple[list, list]:
    """The candidates split by ``estimate``'s memory count (``timemodel.memory_per_rank``,
    the figure ``predict_step`` checks) against the device's memory, before any pricing."""
    cap = profile.memory_bytes or math.inf
    fitting, over = [], []
    for trn in cands:
        (fitting if memory_per_rank(shape, trn)[0] <= cap else over).append(trn)
    return fitting, over


def _ranked(shape, cands: list, profile, k: int, exhaustive: bool) -> list:
    """The ``k`` fastest of ``cands``: every one simulated (``exhaustive``), or branch and
    bound over ``predict_step(..., bound=True)`` (:func:`_best`)."""
    exact = lambda trn: predict_step(shape, trn, profile)  # noqa: E731
    if exhaustive:
        return sorted(((st.step_s, trn, st) for trn in cands for st in (exact(trn),)),
                      key=lambda x: x[0])[:k]
    bounds = ((predict_step(shape, trn, profile, bound=True).step_s, trn) for trn in cands)
    return _best(bounds, k, exact)


def _best(bounded, k: int, exact) -> list:
    """The ``k`` smallest exact steps among ``(bound, layout)`` pairs, simulating in the
    order of the bounds until no remaining bound can beat the k-th best."""
    best: list = []  # (step, order, layout, StepTime), sorted; ties in the layouts' order
    ordered = sorted(((lb, i, trn) for i, (lb, trn) in enumerate(bounded)),
                     key=lambda x: (x[0], x[1]))
    for lb, order, trn in ordered:
        if len(best) >= k and lb * BOUND_SLACK > best[k - 1][0]:
            break
        st = exact(trn)
        best.append((st.step_s, order, trn, st))
        best.sort(key=lambda x: (x[0], x[1]))
        del best[k:]
    return [(step, trn, st) for step, _, trn, st in best]


def why(st) -> str:
    """The reasons a layout ranks where it does, in a line."""
    gb = 2 ** 30
    parts = [f"memory {st.memory_per_rank_bytes / gb:.1f} of {st.device_memory_bytes / gb:.0f} "
             f"GiB"]
    if st.step_s:
        parts.append(f"bubble {100 * st.bubble_s / st.step_s:.1f}%")
        if st.heaviest_axis:
            exp = st.exposed_comm_s.get(st.heaviest_axis, 0.0)
            parts.append(f"exposed {st.heaviest_axis} {100 * exp / st.step_s:.1f}%")
        if st.recompute_s:
            parts.append(f"recompute {100 * st.recompute_s / st.step_s:.1f}%")
    return "; ".join(parts)


def as_dict(trn, st) -> dict:
    """One ranked layout for ``--json``: the layout, the options, precision and optimizer
    (as ``Training`` holds them), the prediction and the reasons."""
    d = asdict(trn)
    return {"layout": d.pop("layout"), "options": d.pop("options"), **d,
            "prediction": asdict(st), "why": why(st)}
