"""Closed forms of ``expert.fastermoe``: dropless expert parallelism with FasterMoE's shadow
experts (He, Zhai, Antunes, Wang, Luo, Shi and Li 2022, "FasterMoE", PPoPP'22, Sec. 4
"shadowing"): the parameters of popular experts are broadcast from their owner to every rank
of the ep group, which computes its own tokens for them locally instead of sending them; the
shadows' gradients are reduced back to the owner.

Per rank, MoE layer and micro-batch (``analytic.expert_dropless`` for the notation and the
rank layout; S = ``moe_shadow``; P = h f + f + f h + h elements of one expert):

- **Counts**: one all-gather of the rank's E int64 counts over ep, so that every rank holds
  the ``[ep, E]`` matrix (the global counts and every split size): (ep - 1)/ep ep E 8 bytes.
- **Shadow choice** (identical on every rank, from the gathered counts): the S experts with
  the most assignments summed over the ep group's routing groups of this micro-batch, ties to
  the lower expert id. Taken here from the single-device reference router's counts
  (``parbench.golden.reference_loads``), never from the implementation.
- **Broadcast** of each shadow's P e bytes from its owner (ep rank x // (E/ep)): a chain from
  the owner, every rank but the chain's last sends P e (``rooted_wire_factor``).
- **Tokens**: ``expert.dropless``'s four uneven all-to-alls with every shadowed expert's
  counts taken out (its tokens stay on their rank): 2 (out + in) h e bytes.
- **Reduce** of each shadow's P-element gradient to its owner (after the backward passes of
  the step's micro-batches, one per shadow, layer and micro-batch): every rank but the owner
  sends P e.
- **Gradients and model states**: ``expert.alltoall``'s (the shadow copies live only inside
  the step; with ``clip_grad`` the norm's all-reduce over ep counts the owners' experts,
  never a shadow).

Headline (FasterMoE Sec. 4 / Fig. 11: under skewed routing shadowing cuts the all-to-all
traffic; their performance model shadows an expert only when that pays): beside the total,
the all-to-all part, ``expert.dropless`` on the same routing and the padded ``[E, C, h]``
buffer of ``expert.alltoall``.
"""
from __future__ import annotations

from fractions import Fraction

from .comm import rooted_wire_factor, wire_factor
from .expert import _moe_shape, expert_numel, rank_states
from .expert_dropless import (COUNT_BYTES, DroplessPrediction, RankStep, add_gradients,
                              dropless_step, ep_peers, group_loads, owner, padded_a2a_wire,
                              token_rows)


def choose_shadows(global_counts: list[int], count: int) -> list[int]:
    """The ``count`` most popular experts (descending count, ties to the lower id), in
    ascending id."""
    ranked = sorted(range(len(global_counts)), key=lambda x: (-global_counts[x], x))
    return sorted(ranked[:count])


def shadow_step(shape, *, ep: int, dp: int, rank: int, loads: list, num_microbatches: int,
                shadows: int, elem_bytes: int = 4, clip_grad: float = 0.0
                ) -> tuple[RankStep, Fraction]:
    """One rank's step and, of its ep bytes, those of the token all-to-alls."""
    st, a2a = RankStep(), Fraction(0)
    E, me = shape.num_experts, rank % ep
    param_bytes = expert_numel(shape) * elem_bytes
    if ep > 1:
        for layer in loads:
            for mb in range(num_microbatches):
                per_rank = group_loads(layer, dp, num_microbatches, mb)
                total = [sum(per_rank[q][x] for q in ep_peers(rank, ep)) for x in range(E)]
                chosen = choose_shadows(total, shadows)
                st.add("ep", wire_factor("all_gather", ep) * ep * E * COUNT_BYTES)
                for x in chosen:
                    st.add("ep", rooted_wire_factor("broadcast", ep, me, owner(x, E, ep))
                           * param_bytes)
                out, into = token_rows(per_rank, rank, ep, E, skip=set(chosen))
                st.add("ep", 2 * (out + into) * shape.h * elem_bytes, 4)
                a2a += 2 * (out + into) * shape.h * elem_bytes
                for x in chosen:
                    st.add("ep", rooted_wire_factor("reduce", ep, me, owner(x, E, ep))
                           * param_bytes)
    add_gradients(st, shape, ep, dp, elem_bytes, clip_grad)
    return st, a2a


def shadow_prediction(model, *, ep: int, dp: int, micro_batch_size: int, num_microbatches: int,
                      loads: list, shadows: int, optimizer: str = "adamw",
                      elem_bytes: int = 4, clip_grad: float = 0.0) -> DroplessPrediction:
    """Every rank's checked steps of ``expert.fastermoe``; ``loads[step][layer][group]``."""
    shape = _moe_shape(model)
    if shadows > shape.num_experts:
        raise ValueError(f"moe_shadow={shadows} exceeds num_experts={shape.num_experts}")
    steps, a2a = [], Fraction(0)
    for lo in loads:
        row = [shadow_step(shape, ep=ep, dp=dp, rank=r, loads=lo, num_microbatches=num_microbatches,
                           shadows=shadows, elem_bytes=elem_bytes, clip_grad=clip_grad)
               for r in range(dp)]
        steps.append([s for s, _ in row])
        a2a = sum((a for _, a in row), Fraction(0))  # the last step's
    last = loads[-1] if loads else []
    plain = [dropless_step(shape, ep=ep, dp=dp, rank=r, loads=last, num_microbatches=num_microbatches,
                           elem_bytes=elem_bytes) for r in range(dp)]
    ours = sum(float(s.wire.get("ep", 0)) for s in steps[-1]) if steps else 0.0
    counts = (dp * len(last) * num_microbatches * wire_factor("all_to_all", ep) * shape.num_experts
              * COUNT_BYTES) if ep > 1 else 0
    plain_a2a = sum(float(s.wire.get("ep", 0)) for s in plain) - float(counts)
    padded = dp * padded_a2a_wire(shape, ep=ep, micro_batch_size=micro_batch_size,
                                  num_microbatches=num_microbatches, capacity_factor=0.0,
                                  elem_bytes=elem_bytes)
    figures = {"ep_wire_bytes_all_ranks": ours,
               "shadow_a2a_wire_bytes_all_ranks": float(a2a),
               "dropless_a2a_wire_bytes_all_ranks": plain_a2a,
               "dropless_ep_wire_bytes_all_ranks": sum(float(s.wire.get("ep", 0))
                                                       for s in plain),
               "alltoall_padded_ep_wire_bytes_all_ranks": padded,
               "shadow_a2a_vs_dropless": float(a2a) / plain_a2a if plain_a2a else None,
               "shadow_param_bytes": expert_numel(shape) * elem_bytes,
               "moe_layers": shape.num_moe_layers}
    return DroplessPrediction(steps, rank_states(shape, ep, optimizer, elem_bytes), figures)
