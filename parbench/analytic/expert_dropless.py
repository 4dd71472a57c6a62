"""Closed forms of ``expert.dropless``: dropless expert parallelism (MegaBlocks, Gale,
Narayanan, Young and Zaharia 2022, arXiv 2211.15841, Sec. 4 "dMoE": no capacity factor, every
expert computes exactly the tokens routed to it, a variable number per expert).

What one rank sends per step (rules the implementation in ``impls/expert/dropless.py``
follows; d = dp ranks, ep | d, m micro-batches of b samples of s tokens, h hidden, e bytes per
element, E experts, rank r = dp rank r, ep rank r mod ep, its ep group the ep consecutive
ranks around it -- the Megatron layout of ``parbench.mesh`` with tp = cp = pp = 1):

- **Counts exchange**: per MoE layer and micro-batch one even all-to-all of the rank's E
  per-expert assignment counts (int64, 8 bytes): (ep - 1)/ep E 8 bytes on the wire. Forward
  only: backward reuses the splits.
- **Tokens** (the variable-size all-to-all): with c_q[x] the assignments (token, choice) of
  rank q's routing group routed to expert x, and R the rank's own E/ep experts,
  out = sum_{x not in R} c_r[x] rows leave the rank in the dispatch (forward) and in the
  combine's gradient (backward); in = sum_{q != r in the ep group} sum_{x in R} c_q[x] rows
  leave it in the combine (forward) and in the dispatch's gradient (backward). Each row is
  h e bytes. Four calls, (2 out + 2 in) h e bytes.
- The per-expert counts c are data: they are taken from the **single-device reference
  router** on the same data (``parbench.golden.reference_loads``: the golden run's parameters of each
  step, the step's global batch, one routing group per rank and micro-batch), never from the
  implementation's ledger.
- **Gradients and model states**: those of ``expert.alltoall`` (``analytic.expert``): the
  dense gradients all-reduced over dp, the experts over edp; the same tensors held; with
  ``clip_grad``, its norm's all-reduce over ep.

Headline (MegaBlocks Fig. 1 / Sec. 3: padding wastes computation and communication): beside
it, ``expert.alltoall``'s padded ``[E, C, h]`` buffer on the same case, 4 (ep-1)/ep E C h e
bytes per MoE layer and micro-batch, whatever the routing (C = T at capacity factor 0, the
only factor that drops nothing).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction

from .comm import as_number, wire_factor
from .expert import _moe_shape, capacity, gradient_traffic, rank_states

#: bytes of one per-expert token count (int64)
COUNT_BYTES = 8


@dataclass
class RankStep:
    """One rank's step: exact wire bytes and calls per axis."""

    wire: dict[str, Fraction] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)

    def add(self, axis: str, wire, calls: int = 1) -> None:
        if calls:
            self.wire[axis] = self.wire.get(axis, Fraction(0)) + Fraction(wire)
            self.calls[axis] = self.calls.get(axis, 0) + calls

    def wire_floats(self) -> dict[str, float]:
        return {a: float(v) for a, v in self.wire.items()}


def ep_peers(rank: int, ep: int) -> list[int]:
    """The dp ranks of ``rank``'s ep group (consecutive ranks, ``parbench.mesh``)."""
    first = rank // ep * ep
    return list(range(first, first + ep))


def owner(expert: int, num_experts: int, ep: int) -> int:
    """The ep rank holding ``expert`` (GShard's sharding of the E axis: blocks of E/ep)."""
    return expert // (num_experts // ep)


def token_rows(loads: list[list[int]], rank: int, ep: int, num_experts: int,
               skip=frozenset()) -> tuple[int, int]:
    """(out, in) rows of ``rank`` for one MoE layer and micro-batch (module docstring);
    ``loads[q]`` is dp rank q's per-expert counts; experts in ``skip`` send nothing (FasterMoE's
    shadows)."""
    me = rank % ep
    out = sum(c for x, c in enumerate(loads[rank])
              if owner(x, num_experts, ep) != me and x not in skip)
    into = sum(loads[q][x] for q in ep_peers(rank, ep) if q != rank
               for x in range(num_experts) if owner(x, num_experts, ep) == me and x not in skip)
    return out, into


def group_loads(loads_layer: list[list[int]], dp: int, num_microbatches: int, mb: int
                ) -> list[list[int]]:
    """Per dp rank, the counts of its micro-batch ``mb``: routing group q m + mb is dp rank q's
    micro-batch mb (``batching.dp_slice`` then ``microbatches``: contiguous rows)."""
    return [loads_layer[q * num_microbatches + mb] for q in range(dp)]


def add_gradients(step: RankStep, shape, ep: int, dp: int, elem_bytes: int,
                  clip_grad: float = 0.0) -> None:
    """``analytic.expert``'s gradient reductions (and the clipping norm's) into ``step``."""
    for t in gradient_traffic(shape, ep, dp, elem_bytes, clip_grad):
        if t.count and t.group_size > 1:
            step.add(t.axis, wire_factor(t.op, t.group_size) * t.message_bytes, t.count)


def dropless_step(shape, *, ep: int, dp: int, rank: int, loads: list, num_microbatches: int,
                  elem_bytes: int = 4, clip_grad: float = 0.0) -> RankStep:
    """One rank's step; ``loads[layer][group][expert]`` from the reference router."""
    st = RankStep()
    row = shape.h * elem_bytes
    if ep > 1:
        for layer in loads:
            for mb in range(num_microbatches):
                out, into = token_rows(group_loads(layer, dp, num_microbatches, mb), rank, ep,
                                       shape.num_experts)
                st.add("ep", wire_factor("all_to_all", ep) * shape.num_experts * COUNT_BYTES)
                st.add("ep", 2 * (out + into) * row, 4)
    add_gradients(st, shape, ep, dp, elem_bytes, clip_grad)
    return st


def padded_a2a_wire(shape, *, ep: int, micro_batch_size: int, num_microbatches: int,
                    capacity_factor: float, elem_bytes: int = 4) -> int | float:
    """``expert.alltoall``'s all-to-all bytes of one rank per step at ``capacity_factor``
    (GShard's ``[E, C, h]`` buffer, 4 calls per MoE layer and micro-batch)."""
    c = capacity(micro_batch_size * shape.s, shape.num_experts, shape.moe_top_k, capacity_factor)
    if ep == 1:
        return 0
    return as_number(4 * wire_factor("all_to_all", ep) * shape.num_experts * c * shape.h
                     * elem_bytes * shape.num_moe_layers * num_microbatches)


@dataclass
class DroplessPrediction:
    """Per checked step, per rank: wire bytes and calls; the model states; figures."""

    steps: list[list[RankStep]]
    states: dict[str, int]
    figures: dict


def dropless_prediction(model, *, ep: int, dp: int, micro_batch_size: int, num_microbatches: int,
                        loads: list, optimizer: str = "adamw", elem_bytes: int = 4,
                        clip_grad: float = 0.0) -> DroplessPrediction:
    """Every rank's checked steps of ``expert.dropless``; ``loads[step][layer][group]``."""
    shape = _moe_shape(model)
    steps = [[dropless_step(shape, ep=ep, dp=dp, rank=r, loads=lo, num_microbatches=num_microbatches,
                            elem_bytes=elem_bytes, clip_grad=clip_grad) for r in range(dp)]
             for lo in loads]
    return DroplessPrediction(steps, rank_states(shape, ep, optimizer, elem_bytes),
                              headline(shape, steps, ep=ep, dp=dp, micro_batch_size=micro_batch_size,
                                       num_microbatches=num_microbatches, elem_bytes=elem_bytes))


def headline(shape, steps: list[list[RankStep]], *, ep: int, dp: int, micro_batch_size: int,
             num_microbatches: int, elem_bytes: int) -> dict:
    """The ep-axis bytes of the last step summed over ranks, beside the padded buffers of
    ``expert.alltoall`` at capacity factor 0 (the same semantics) and 1.0 (drops tokens)."""
    ours = sum(float(s.wire.get("ep", 0)) for s in steps[-1]) if steps else 0.0
    padded = {cf: dp * padded_a2a_wire(shape, ep=ep, micro_batch_size=micro_batch_size,
                                       num_microbatches=num_microbatches, capacity_factor=cf,
                                       elem_bytes=elem_bytes) for cf in (0.0, 1.0)}
    return {"ep_wire_bytes_all_ranks": ours,
            "alltoall_padded_ep_wire_bytes_all_ranks": padded[0.0],
            "alltoall_cf1_ep_wire_bytes_all_ranks": padded[1.0],
            "ep_bytes_vs_padded": ours / padded[0.0] if padded[0.0] else None,
            "capacity": micro_batch_size * shape.s, "moe_layers": shape.num_moe_layers}
