"""What ``expert.tutel`` must measure, per rank and step: Tutel's adaptive MoE layer (Hwang et
al. 2023, "Tutel: Adaptive Mixture-of-Experts at Scale", MLSys 2023, arXiv 2206.03382) on the
expert-parallel layout of ``analytic.expert``. Written from the paper and the stated rules
below, never from the implementation; the only data-dependent input, the tokens each expert
receives, comes from the single-device reference router on the same data
(``parbench.golden.reference_loads``: the golden run's parameters before each step, the step's
batch), which the scheme's ``predict`` runs and hands in.

Notation (per rank; d = dp ranks, ep | d, W = ep, m micro-batches of b samples of s tokens,
T = b s, E experts of P_e = 2 h f + f + h elements, e = 4 bytes, L_moe MoE layers). Rank r
(= its dp index: tp = cp = pp = 1) is in ep group r // W; its micro-batch i is the reference's
routing group r m + i; n_{g,x} is the reference's count of assignments of group g to expert x.

- **Adaptive capacity** (Tutel's dynamic capacity): per layer and micro-batch
  C = min(B, max over the group's ranks q and experts x of n_{q m + i, x}), B the Switch
  capacity ceil(cf k T / E) (Switch Eq. 3) when cf > 0 (Tutel's upper bound on the factor),
  no bound when cf = 0. Agreeing on it costs one all-reduce of one int64 (8 bytes) over ep,
  2 (W-1)/W 8 wire bytes, in modes ep and adaptive (mode dp has no buffer to agree on).
- **EP mode** (GShard Sec. 3.2; Tutel's EP): 4 all-to-alls (dispatch, combine, and
  their gradients) of E C h e bytes: flat, (W-1)/W of it on axis ep; 2-D (Tutel's 2DH
  all-to-all, N = W / L nodes of L = 2 ranks), each all-to-all is two calls of the same
  message, (L-1)/L on axis ep_intra and (N-1)/N on ep_inter (a phase over one rank: none).
- **DP mode** (Tutel, "Adaptive Parallelism Switching": the EP layout kept, experts gathered):
  one all-gather of the layer's E P_e e bytes of experts over ep and one reduce-scatter of
  their gradients, (W-1)/W each.
- **Adaptive**: EP iff 4 E C h a <= 2 E P_e (W-1)/W (a: the all-to-all's summed wire factor
  above), i.e. the mode with fewer wire bytes, ties to EP.
- **Gradients** and **model states**: exactly ``analytic.expert``'s (dense all-reduce over
  dp, expert all-reduce over edp, E/ep experts per rank; with ``clip_grad`` the norm's
  all-reduce over ep -- in mode dp too, whose reduce-scatter leaves each expert's gradient on
  its owner only); the gathered experts are transient.
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from .comm import Transfer, as_number, wire_factor
from .expert import capacity as switch_capacity
from .expert import expert_numel, gradient_traffic, rank_states
from .prediction import RankPrediction
from .shape import Shape, require_positive_int, shape_from

#: local ranks per "node" of the 2-D all-to-all (stated; ep must be a multiple of it)
RANKS_PER_NODE = 2
#: bytes of the all-reduced need (one int64)
NEED_BYTES = 8


def a2a_phases(ep: int, a2a: str, local: int = RANKS_PER_NODE) -> list[tuple[str, int]]:
    """(axis, group size) of each call of one all-to-all; groups of one rank left out."""
    require_positive_int("ep", ep)
    if a2a == "flat":
        phases = [("ep", ep)]
    elif a2a == "2d":
        if ep % local:
            raise ValueError(f"ep={ep} is not a multiple of {local} ranks per node")
        phases = [("ep_intra", local), ("ep_inter", ep // local)]
    else:
        raise ValueError(f"moe_a2a={a2a!r} must be flat or 2d")
    return [(a, n) for a, n in phases if n > 1]


def a2a_wire_factor(ep: int, a2a: str) -> Fraction:
    """Wire bytes per message byte of one (flat or 2-D) all-to-all."""
    return sum((wire_factor("all_to_all", n) for _, n in a2a_phases(ep, a2a)), Fraction(0))


def chosen_mode(mode: str, cap: int, shape: Shape, ep: int, a2a: str) -> str:
    """The mode a layer runs in: ``mode`` itself, or for ``adaptive`` the one with fewer wire
    bytes (module docstring; ties: ep)."""
    if mode != "adaptive":
        return mode
    e = shape.num_experts
    ep_bytes = 4 * e * cap * shape.h * a2a_wire_factor(ep, a2a)
    dp_bytes = 2 * e * expert_numel(shape) * wire_factor("all_gather", ep)
    return "ep" if ep_bytes <= dp_bytes else "dp"


def layer_transfers(shape: Shape, ep: int, a2a: str, mode: str, cap: int,
                    elem_bytes: int = 4) -> tuple[list[Transfer], str]:
    """One MoE layer and micro-batch: its transfers and the mode it runs in."""
    chosen = chosen_mode(mode, cap, shape, ep, a2a)
    if ep == 1:
        return [], chosen
    out = []
    if mode != "dp":
        out.append(Transfer("ep", "all_reduce", ep, NEED_BYTES, 1, "capacity: MAX of the need"))
    if chosen == "ep":
        msg = shape.num_experts * cap * shape.h * elem_bytes
        out += [Transfer(axis, "all_to_all", n, msg, 4, "dispatch, combine (fwd, bwd)")
                for axis, n in a2a_phases(ep, a2a)]
    else:
        msg = shape.num_experts * expert_numel(shape) * elem_bytes
        out += [Transfer("ep", "all_gather", ep, msg, 1, "experts gathered (fwd)"),
                Transfer("ep", "reduce_scatter", ep, msg, 1, "expert grads to owners (bwd)")]
    return out, chosen


def capacities(counts_step: list, rank: int, ep: int, num_microbatches: int,
               bound: int | None) -> list[int]:
    """C of every MoE layer and micro-batch (layer major) of ``rank`` in one step."""
    first = rank // ep * ep
    out = []
    for layer in counts_step:
        for i in range(num_microbatches):
            need = max(max(layer[q * num_microbatches + i]) for q in range(first, first + ep))
            out.append(need if bound is None else min(bound, need))
    return out


def local_needs(counts_step: list, rank: int, num_microbatches: int, bound: int | None
                ) -> list[int]:
    """Mode dp: each layer-micro-batch's own need (nothing agreed)."""
    out = []
    for layer in counts_step:
        for i in range(num_microbatches):
            need = max(layer[rank * num_microbatches + i])
            out.append(need if bound is None else min(bound, need))
    return out


def rank_needs(counts_step: list, rank: int, ep: int, num_microbatches: int,
               bound: int | None, mode: str) -> list[int]:
    """The capacities ``rank`` runs in one step: agreed over its ep group (modes ep and
    adaptive), its own needs (mode dp)."""
    if mode == "dp":
        return local_needs(counts_step, rank, num_microbatches, bound)
    return capacities(counts_step, rank, ep, num_microbatches, bound)


@dataclass
class TutelPrediction:
    """Per checked step and rank (``wire[step][rank]``): wire bytes and calls per axis; the
    model states of every rank (the same on each); figures for the report."""

    wire: list[list[dict[str, float]]]
    calls: list[list[dict[str, int]]]
    states: dict[str, int]
    figures: dict


def tutel_prediction(case, counts: list) -> TutelPrediction:
    """Per rank and checked step: wire bytes and calls per axis, model states and figures of
    ``expert.tutel``. ``counts[step][layer][group][expert]``: the reference router's counts
    of the checked steps (``parbench.golden.reference_loads``, which the caller runs: this
    closed form is arithmetic on them)."""
    shape, p, m = shape_from(case.model), case.layout, case.layout.num_microbatches
    ep, mode, a2a = p.ep, case.options.expert.moe_mode, case.options.expert.moe_a2a
    cf = shape.moe_capacity_factor
    tokens = p.micro_batch_size * shape.s
    bound = switch_capacity(tokens, shape.num_experts, shape.moe_top_k, cf) if cf else None
    states = rank_states(shape, ep, case.run.optimizer)
    grads = [t for t in gradient_traffic(shape, ep, p.dp, clip_grad=case.run.clip_grad)
             if t.count and t.group_size > 1]
    wire, calls, caps0, modes0 = [], [], [], []
    for step_counts in counts:
        w_step, c_step = [], []
        for r in range(p.dp):
            caps = rank_needs(step_counts, r, ep, m, bound, mode)
            tr, modes = list(grads), []
            for cap in caps:
                t, chosen = layer_transfers(shape, ep, a2a, mode, cap)
                tr += t
                modes.append(chosen)
            rp = RankPrediction(tr, states)
            w_step.append(rp.wire_bytes)
            c_step.append(rp.calls)
            if r == 0:
                caps0.append(caps)
                modes0.append(modes)
        wire.append(w_step)
        calls.append(c_step)
    figures = tutel_figures(shape, ep, a2a, tokens, m, bound, counts[-1] if counts else None)
    figures.update({"capacity_per_step_rank0": caps0, "mode_per_step_rank0": modes0,
                    "buffer_bytes_adaptive_mean_rank0": as_number(Fraction(
                        sum(map(sum, caps0)) * shape.num_experts * shape.h * 4,
                        max(sum(map(len, caps0)), 1)))})
    return TutelPrediction(wire, calls, dict(states), figures)


def tutel_figures(shape: Shape, ep: int, a2a: str, tokens: int, num_microbatches: int,
                  bound: int | None, last_counts: list | None) -> dict:
    """The static capacity and buffer beside the adaptive one, the all-to-all's peers and
    wire factor, mode dp's bytes, and rank 0's MoE wire bytes in the last step under each
    mode (``last_counts``: that step's counts)."""
    static = switch_capacity(tokens, shape.num_experts, shape.moe_top_k,
                             shape.moe_capacity_factor)
    by_mode = {}
    for mo in ("ep", "dp", "adaptive"):
        caps = (rank_needs(last_counts, 0, ep, num_microbatches, bound, mo)
                if last_counts else [])
        by_mode[mo] = as_number(sum((t.total_wire_bytes for cap in caps
                                     for t in layer_transfers(shape, ep, a2a, mo, cap)[0]),
                                    Fraction(0)))
    return {
        "capacity_static": static, "capacity_bound": bound,
        "buffer_bytes_static": static * shape.num_experts * shape.h * 4,
        "a2a_peers_flat": ep - 1,
        "a2a_peers_2d": sum(n - 1 for _, n in a2a_phases(ep, "2d")) if ep % 2 == 0 else None,
        "a2a_wire_factor": as_number(a2a_wire_factor(ep, a2a)),
        "dp_mode_wire_bytes_per_layer": as_number(2 * wire_factor("all_gather", ep)
                                                  * shape.num_experts * 4
                                                  * expert_numel(shape)),
        "expert_numel": expert_numel(shape), "moe_wire_bytes_rank0_by_mode": by_mode,
        "inter_node_message_ratio_2d_vs_flat": RANKS_PER_NODE if a2a == "2d" else None}
