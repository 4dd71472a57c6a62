"""The planner's exact search over groups of layouts (``plan.plan``; its module doc states
what is pruned and why the top list stays the exhaustive one).

A *group* is one grid (tp, cp, ep, etp, dp, pp and uneven ends) at one micro-batch size;
its members are every (schedule, vpp) times every option set (ZeRO stage, recomputation,
context-parallel algorithm), in the order ``plan.layouts`` yields them. A group's memory
is counted whole (:func:`fits_mask`, exactly ``timemodel.memory_per_rank``'s figure); its
*pipes* are its (schedule, vpp, recomputation, algorithm) -- what the pipeline's makespan
depends on. The search is best first over three kinds of entries, each keyed by a lower
bound of every layout below it:

- a group: ``loss + (1 - 1e-9) m W / p`` (:func:`group_bound`), W the least, over the
  group's recomputations and algorithms, of one micro-batch's busy time summed over the
  model's layers and ends;
- a pipe: the makespan bound ``predict_step(..., bound=True)`` uses, plus the loss;
- a layout: ``predict_step(..., bound=True).step_s`` itself.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field, replace

import numpy as np

from .analytic.counting import Counting
from .analytic.rank_memory import padded_shape, rank_activations, rank_states
from .analytic.shape import shape_from
from .layout import Layout
from .schedules import WeightRule, get_spec
from .timemodel import Training, predict_step
from .timemodel import model as tm
from .timemodel.costs import _e
from .timemodel.dp_memory import _inflight
from .timemodel.transformer_layer import layer_costs

#: the group bound's margin for float rounding: W summed layer by layer here, stage by stage
#: in the model
_ROUNDING = 1.0 - 1e-9


@dataclass
class Group:
    """One grid at one micro-batch size (``grid`` carries b and m) and its members."""

    order: int
    grid: Layout
    scheds: list  # (schedule, vpp)
    base: Training
    options: list  # Options, in the order of plan._per_degrees
    fits: list = field(default_factory=list)  # per schedule: a bool per option
    memo: dict = field(default_factory=dict)  # layouts by schedule, stage costs by options

    @property
    def size(self) -> int:
        return len(self.scheds) * len(self.options)

    def member(self, si: int, oi: int) -> Training:
        lay = self.memo.get(si)
        if lay is None:
            name, vpp = self.scheds[si]
            lay = self.memo[si] = replace(self.grid, vpp=vpp, schedule=name)
        return replace(self.base, layout=lay, options=self.options[oi])


def fits_mask(shape, group: Group, cap: float, memo: dict | None = None) -> list[list[bool]]:
    """Per schedule of the group, whether each option's layout fits in ``cap`` bytes:
    ``memory_per_rank``'s sum (``rank_memory.peak_rank_memory``: states + held x in flight
    + working + logits, the most loaded rank), the same float operations on arrays.
    ``memo``: the per-rank arrays of one search, shared by its groups."""
    memo = {} if memo is None else memo
    g = group.grid
    zeros = sorted({o.data.zero_stage for o in group.options})
    rcs = sorted({o.recompute for o in group.options})
    pick = [(zeros.index(o.data.zero_stage), rcs.index(o.recompute)) for o in group.options]
    out = []
    for name, vpp in group.scheds:
        states, held, work, logits = _rank_arrays(shape, group, vpp, tuple(zeros), tuple(rcs),
                                                  memo)
        fkey = (name, g.pp, g.num_microbatches, vpp)
        flight = memo.get(fkey)
        if flight is None:
            flight = memo[fkey] = np.array([float(_inflight(name, g.pp, g.num_microbatches,
                                                            r, vpp)) for r in range(g.pp)])
        total = states[:, None, :] + held[None, :, :] * flight + work[None, :, :] + logits
        ok = (total.max(axis=2) <= cap).tolist()
        out.append([ok[z][r] for z, r in pick])
    return out


def _rank_arrays(shape, group: Group, vpp: int, zeros: tuple, rcs: tuple, memo: dict):
    """(states per ZeRO stage, held and working per recomputation, logits) per rank as
    arrays: ``rank_memory.rank_states`` and ``rank_activations`` of the group's grid."""
    g, base = group.grid, group.base
    grid = (g.tp, g.cp, g.ep, g.etp, g.dp, g.pp, vpp, g.first_stage_layers,
            g.last_stage_layers)
    sp = base.options.tensor.sp and g.tp > 1
    key = (grid, g.micro_batch_size, sp, zeros, rcs, base.dtype, base.accounting,
           base.attention)
    hit = memo.get(key)
    if hit is None:
        shp = padded_shape(shape_from(shape), g.tp)
        counting = Counting(bytes_per_element=_e(base.dtype), accounting=base.accounting,
                            attention=base.attention)
        skey = (grid, zeros, counting.accounting_name)
        states = memo.get(skey)
        if states is None:
            states = memo[skey] = np.array([rank_states(shp, grid, z, counting.accounting_name)
                                            for z in zeros])
        acts = [rank_activations(shp, grid, g.micro_batch_size, sp, rc, counting)
                for rc in rcs]
        hit = memo[key] = (states, np.array([a[0] for a in acts]),
                           np.array([a[1] for a in acts]), np.array(acts[0][2]))
    return hit


class Bounds:
    """The group and pipe bounds of one search (its shape and profile), with the layer
    costs' totals memoised by what they depend on (not dp, pp or the schedule)."""

    def __init__(self, shape, profile):
        self.shape, self.profile = shape, profile
        self.n_moe = len(tm._moe_layers(shape))
        self._work: dict = {}

    def work(self, trn: Training) -> float:
        """One micro-batch's busy time summed over every layer and both ends."""
        lay, opt = trn.layout, trn.options
        key = (lay.tp, lay.cp, lay.ep, lay.etp, lay.micro_batch_size, opt.tensor.sp,
               opt.recompute, opt.context.cp_algorithm)
        hit = self._work.get(key)
        if hit is None:
            shape, prof = self.shape, self.profile
            busy = lambda c: c.tf + c.tb + c.w  # noqa: E731
            emb, head = tm._ends(shape, trn, prof)
            hit = (shape.l - self.n_moe) * busy(layer_costs(shape, trn, prof, False)) \
                + busy(emb) + busy(head)
            if self.n_moe:
                hit += self.n_moe * busy(layer_costs(shape, trn, prof, True))
            self._work[key] = hit
        return hit

    def group_bound(self, group: Group) -> float:
        """A lower bound of every member's ``predict_step(..., bound=True).step_s``: the
        loss all-reduce (the grid's) plus the busiest rank's work, at least the mean over the
        p ranks of the m micro-batches' work (every schedule's ranks together run each
        stage m times; what a schedule adds -- blocking sends, split-backward calls,
        PipeDream's updates -- only adds); the dp sync and the optimizer are >= 0."""
        g = group.grid
        trn = group.member(0, 0)
        loss = tm._loss_allreduce_time(trn, self.profile)
        for name, vpp in group.scheds:
            if g.pp > 1 and get_spec(name).placement.num_stages(g.pp, vpp) != g.pp * vpp:
                return loss  # busy_bound has no figure there: the makespan bound is 0
        seen = {(o.recompute, o.context.cp_algorithm): o for o in group.options}
        least = min(self.work(replace(trn, options=o)) for o in seen.values())
        return loss + _ROUNDING * g.num_microbatches * least / g.pp

    def stages(self, group: Group, trn: Training):
        """The stage costs of the group at ``trn``'s vpp and options (memoised: every
        schedule of that vpp shares them; ``priced_pipeline`` copies them)."""
        opt = trn.options
        key = (trn.layout.vpp, opt.recompute, opt.context.cp_algorithm)
        hit = group.memo.get(key)
        if hit is None:
            hit = group.memo[key] = tm._stage_costs(self.shape, trn, self.profile)
        return hit


class Pipe:
    """One (schedule, vpp, recomputation, algorithm) of a group and its fitting members
    ``ois`` (their ZeRO stages): the stage costs and the pipeline priced once for all of
    them (``timemodel.model.priced_pipeline``), as a bound and, when a member is
    simulated, exactly. PipeDream's per-micro-batch updates read the ZeRO stage: there
    each member is priced by ``predict_step`` alone."""

    def __init__(self, bounds: Bounds, group: Group, si: int, ois: list[int]):
        self.bounds, self.group, self.si, self.ois = bounds, group, si, ois
        self._trns: list | None = None
        name = group.scheds[si][0]
        self.per_zero = group.grid.pp > 1 and \
            get_spec(name).weight_rule is WeightRule.PIPEDREAM
        self._exact = None

    @property
    def trns(self) -> list[Training]:
        """The members, made when first asked for (most pipes are never expanded)."""
        if self._trns is None:
            self._trns = [self.group.member(self.si, oi) for oi in self.ois]
        return self._trns

    def key(self) -> float:
        """The pipe's bound: the makespan bound plus the loss (module doc)."""
        spans = []
        first = [self.group.member(self.si, self.ois[0])]
        for trn in (self.trns if self.per_zero else first):
            stages, pipe = self._bound = self._priced(trn, True)
            spans.append(pipe.makespan + tm._loss_allreduce_time(trn, self.bounds.profile))
        return min(spans)

    def _priced(self, trn: Training, bound: bool):
        b = self.bounds
        return tm.priced_pipeline(b.shape, trn, b.profile, bound=bound, bubble=False,
                                  stages=b.stages(self.group, trn))

    def lower_bounds(self) -> list[float]:
        """``predict_step(t, bound=True).step_s`` of each member."""
        b = self.bounds
        if self.per_zero:
            return [predict_step(b.shape, t, b.profile, bound=True).step_s for t in self.trns]
        stages, pipe = self._bound
        return [tm.step_seconds(b.shape, t, b.profile, stages, pipe) for t in self.trns]

    def step(self, trn: Training) -> float:
        """``predict_step(trn).step_s``, the schedule simulated once for the pipe."""
        b = self.bounds
        if self.per_zero:
            return predict_step(b.shape, trn, b.profile).step_s
        if self._exact is None:
            self._exact = self._priced(trn, False)
        return tm.step_seconds(b.shape, trn, b.profile, *self._exact)


@dataclass
class Counts:
    """What the search did: layouts whose lower bound was priced, layouts simulated, layouts
    never priced because a group's or pipe's bound could not beat the k-th best."""

    bounded: int = 0
    simulated: int = 0
    skipped: int = 0


def search(shape, groups: list[Group], profile, k: int, slack: float):
    """The ``k`` fastest fitting layouts of ``groups`` (their memory masks filled), best
    first over group, pipe and layout entries (module doc); returns (ranked as
    ``(step, order, Training, StepTime)``, Counts)."""
    bounds = Bounds(shape, profile)
    heap = [(bounds.group_bound(g), g.order, -1, 0, g) for g in groups
            if any(any(row) for row in g.fits)]
    heapq.heapify(heap)
    counts = Counts()
    best: list = []  # (step, (group, member), Training, Pipe)
    while heap:
        key, gi, mi, kind, what = heapq.heappop(heap)
        if len(best) >= k and key * slack > best[k - 1][0]:
            heap.append((key, gi, mi, kind, what))
            break
        if kind == 0:
            for pipe in _pipes(bounds, what):
                heapq.heappush(heap, (pipe.key(), gi, pipe.si * len(what.options) +
                                      pipe.ois[0], 1, pipe))
        elif kind == 1:
            n = len(what.group.options)
            for oi, trn, lb in zip(what.ois, what.trns, what.lower_bounds()):
                heapq.heappush(heap, (lb, gi, what.si * n + oi, 2, (trn, what)))
            counts.bounded += len(what.ois)
        else:
            trn, pipe = what
            counts.simulated += 1
            best.append((pipe.step(trn), (gi, mi), trn))
            best.sort(key=lambda x: (x[0], x[1]))
            del best[k:]
    counts.skipped = sum(_unpriced(kind, what) for _, _, _, kind, what in heap)
    return [(step, order, trn, predict_step(shape, trn, profile))
            for step, order, trn in best], counts


def _pipes(bounds: Bounds, group: Group):
    """Each pipe of the group with fitting members, in member order."""
    for si in range(len(group.scheds)):
        by: dict = {}
        for oi, o in enumerate(group.options):
            if group.fits[si][oi]:
                by.setdefault((o.recompute, o.context.cp_algorithm), []).append(oi)
        yield from (Pipe(bounds, group, si, ois) for ois in by.values())


def _unpriced(kind: int, what) -> int:
    """Fitting layouts below a heap entry left when the search stopped."""
    if kind == 2:
        return 0
    if kind == 1:
        return len(what.ois)
    return sum(sum(row) for row in what.fits)


def fitting(groups: list[Group]) -> int:
    return sum(sum(row) for g in groups for row in g.fits)


def cap_of(profile) -> float:
    return profile.memory_bytes or math.inf
