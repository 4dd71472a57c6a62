"""The planner: every parallel layout of a model on N devices, pruned by the divisibility rules
and by memory, ranked by the time model's predicted step time (``parbench plan``).

The search space, per layout (Narayanan et al. 2021 Sec. 3 give the rules of PTD-P; cp and ep
as Megatron-Core lays them out):

- tp divides the attention heads (and, with ``max_tp``, at most a node's devices: Megatron
  keeps tensor parallelism inside the NVLink domain); cp divides the sequence into 2 cp
  chunks (the load-balanced split); pp divides the layers; dp = N / (tp cp pp);
- ep divides the experts and tp cp dp (it re-partitions them, expert-tp 1);
- vpp (interleaved 1F1B) divides the layers per stage, and needs m divisible by pp;
- micro-batch size b divides the global batch per dp rank, m = B / (dp b); pipelines need
  m >= pp;
- schedule: 1F1B, GPipe, ZB-H1 and ZB-H2 with one stage per rank, interleaved 1F1B with
  vpp > 1, ZB-V and DualPipeV with two chunks per rank (pp = 1: no schedule);
- ZeRO stage 0-3, recompute none / selective / full.

Every layout is priced by ``parbench.timemodel.predict_step``; those that do not fit in the
device's memory are dropped, the rest ranked by step time. The schedule simulator runs only for
layouts whose lower bound (the step without a bubble) could still make the top list (``plan``),
so the search costs one closed-form pricing per layout and a few hundred simulations.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable

from .config import ConfigError


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class Space:
    """What the planner may choose (defaults: everything the rules allow)."""

    max_tp: int = 8
    max_cp: int = 8
    micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    schedules: tuple[str, ...] = ("1f1b", "gpipe", "zb-h1", "zb-h2", "interleaved", "zbv",
                                  "dualpipev")
    vpps: tuple[int, ...] = (2, 3, 4)
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    recomputes: tuple[str, ...] = ("none", "selective", "full")


@dataclass
class PlanResult:
    """The ranked layouts that fit, and what the search saw."""

    ranked: list  # (Layout, StepTime), fastest first
    evaluated: int
    over_memory: int
    seconds: float
    best_over_memory: list = field(default_factory=list)  # the fastest that did not fit


def layouts(shape, world: int, global_batch: int, space: Space = Space()):
    """Every layout of ``shape`` on ``world`` devices the rules allow (a generator of
    ``timemodel.Layout``)."""
    from .timemodel import Layout
    heads, layers, seq = shape.a, shape.l, shape.s
    experts = shape.num_experts
    for tp in divisors(world):
        if tp > space.max_tp or heads % tp:
            continue
        for cp in divisors(world // tp):
            if cp > space.max_cp or seq % (2 * cp):
                continue
            for pp in divisors(world // (tp * cp)):
                if layers % pp:
                    continue
                dp = world // (tp * cp * pp)
                if global_batch % dp:
                    continue
                eps = [e for e in divisors(experts) if (tp * cp * dp) % e == 0] \
                    if experts else [1]
                for ep in eps:
                    yield from _per_degrees(Layout, shape, tp, cp, ep, dp, pp, global_batch,
                                            space)


def _per_degrees(layout_cls, shape, tp, cp, ep, dp, pp, global_batch, space):
    per_rank = global_batch // dp
    for b in space.micro_batch_sizes:
        if per_rank % b:
            continue
        m = per_rank // b
        if pp > 1 and m < pp:
            continue
        for schedule, vpp in _schedules(shape.l // pp, pp, m, space):
            for zero in space.zero_stages:
                if zero and dp == 1:
                    continue  # nothing to shard over
                for rc in space.recomputes:
                    yield layout_cls(tp=tp, cp=cp, ep=ep, dp=dp, pp=pp, vpp=vpp,
                                     sp=tp > 1, schedule=schedule, zero_stage=zero,
                                     recompute=rc, micro_batch_size=b, num_microbatches=m)


#: the V-shaped schedules: always two chunks per rank (Qi et al. 2024; DeepSeek-V3)
_V_SHAPES = ("zbv", "dualpipev")
#: the fewest micro-batches a schedule runs with on p stages (its generator's rule; m >= p
#: for the others)
_MIN_M = {"zb-h2": lambda p: 2 * p - 1, "dualpipev": lambda p: 2 * p}


def _schedules(layers_per_stage: int, pp: int, m: int, space: Space):
    if pp == 1:
        yield "1f1b", 1
        return
    for s in space.schedules:
        if m < _MIN_M.get(s, lambda p: p)(pp):
            continue
        if s in _V_SHAPES:
            if layers_per_stage % 2 == 0:
                yield s, 2  # two chunks per rank, stages r and 2p - 1 - r
            continue
        if s != "interleaved":
            yield s, 1
            continue
        if m % pp:
            continue
        for v in space.vpps:
            if layers_per_stage % v == 0:
                yield s, v


#: the planner simulates a layout whose lower bound is within this factor of its current
#: k-th best step (the bound is the busiest rank's busy time; the simulator rounds stage
#: costs to 3 significant figures and may pick another critical rank on near ties)
BOUND_SLACK = 0.95


def plan(shape, world: int, profile, global_batch: int, space: Space = Space(),
         predictor: Callable | None = None, keep: int = 10,
         exhaustive: bool = False) -> PlanResult:
    """Price every layout; keep the ``keep`` fastest that fit (and the fastest few that do
    not, to say what memory cost).

    Branch and bound: every layout is first priced with ``predict_step(..., bound=True)``
    (no schedule simulation: a lower bound of its step); then, in the order of the bounds,
    layouts are simulated until the next bound exceeds the ``keep``-th best simulated step
    (``BOUND_SLACK``), so the top list is the exhaustive search's (``exhaustive=True``
    simulates everything: what the tests compare it with). A custom ``predictor`` is called
    once per layout."""
    if world < 1:
        raise ConfigError(f"world={world} must be >= 1")
    if global_batch < 1:
        raise ConfigError(f"global_batch_size={global_batch} must be >= 1")
    t0 = time.perf_counter()
    if predictor is not None or exhaustive:
        if predictor is None:
            from .timemodel import predict_step as predictor
        exact = lambda lay: predictor(shape, lay, profile)  # noqa: E731
        priced = [(st.step_s, lay, st) for lay in layouts(shape, world, global_batch, space)
                  for st in (exact(lay),)]
        fits = sorted((x for x in priced if x[2].fits), key=lambda x: x[0])[:keep]
        over = sorted((x for x in priced if not x[2].fits), key=lambda x: x[0])[:3]
        n, n_over = len(priced), sum(1 for x in priced if not x[2].fits)
    else:
        from .timemodel import predict_step
        bounds = [(predict_step(shape, lay, profile, bound=True), lay)
                  for lay in layouts(shape, world, global_batch, space)]
        n, n_over = len(bounds), sum(1 for b, _ in bounds if not b.fits)
        exact = lambda lay: predict_step(shape, lay, profile)  # noqa: E731
        fits = _best(((b.step_s, lay) for b, lay in bounds if b.fits), keep, exact)
        over = _best(((b.step_s, lay) for b, lay in bounds if not b.fits), 3, exact)
    return PlanResult(ranked=[(lay, st) for _, lay, st in fits], evaluated=n,
                      over_memory=n_over,
                      seconds=time.perf_counter() - t0,
                      best_over_memory=[(lay, st) for _, lay, st in over])


def _best(bounded, k: int, exact) -> list:
    """The ``k`` smallest exact steps among ``(bound, layout)`` pairs, simulating in the
    order of the bounds until no remaining bound can beat the k-th best."""
    best: list = []  # (step, order, layout, StepTime), sorted
    for order, (lb, lay) in enumerate(sorted(bounded, key=lambda x: x[0])):
        if len(best) >= k and lb * BOUND_SLACK > best[k - 1][0]:
            break
        st = exact(lay)
        best.append((st.step_s, order, lay, st))
        best.sort(key=lambda x: (x[0], x[1]))
        del best[k:]
    return [(step, lay, st) for step, _, lay, st in best]


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


def as_dict(lay, st) -> dict:
    return {"layout": asdict(lay), "prediction": asdict(st), "why": why(st)}
