"""LoongTrain's 2D-Attention with Double-Ring-Attention: what one rank must send per step.

Gu et al. 2024, "LoongTrain: Efficient Training of Long-Sequence LLMs with Head-Context
Parallelism" (arXiv 2406.18485), Sec. 4: the cp ranks form a head-parallel x context-parallel
grid, u = ``cp_ulysses`` ranks sharing heads (all-to-all, DeepSpeed-Ulysses) by c = cp/u
ranks sharing the sequence (ring); the context ring is cut into c/w windows (inner rings) of
w = ``cp_window`` ranks joined by an outer ring (Double-Ring-Attention). The paper's
communication analysis keeps Ulysses' and Ring Attention's volumes -- 2D-Attention changes
*which* group carries them, Double-Ring-Attention *which links* carry the ring's hops and how
many inner steps hide one outer hop (w instead of 1) -- and that is the closed form here,
written from the pattern, per layer and micro-batch (b samples, e bytes per element):

- **head (Ulysses) group**, axis ``cp_ulysses``: 4 all-to-alls forward (Q, K, V, output),
  the 4 inverse ones backward, each of the rank's own b (s/cp) h elements (Jacobs et al.
  2023, Sec. 3.2); recomputation adds the forward's 4;
- **K/V block** of a context rank: 2 b (s/c) (h/u) e bytes (the u-group's gathered s/c
  tokens, h/u of the width);
- **grouped-query attention** (Ainslie et al. 2023; g = num_kv_heads K/V heads of
  head_dim, h_kv = g head_dim): K and V are g heads wide from the projection on, so the head
  group's K and V all-to-alls move b (s/cp) h_kv each (Q and the output keep h), and the K/V
  block is 2 b (s/c) (h_kv/u) e -- a rank's g/u K/V heads, the ones its a/u query heads read
  (u must divide g, the Ulysses rule for K/V heads);
- **inner ring**, axis ``cp_inner``: w - 1 K/V sends per outer step, c/w outer steps, in
  forward and again in backward, plus as many dK/dV sends in backward: (c/w)(w - 1) each;
- **outer ring**, axis ``cp_outer``: c/w - 1 K/V sends forward, again backward, and c/w - 1
  dK/dV sends (an accumulator picks up each window's total at its entry rank).

Inner plus outer hops: (c/w)(w-1) + c/w - 1 = c - 1, the single ring's count, so the total
is byte for byte USP's (Fang & Zhao 2024) on the same u x c grid (:func:`versus_usp`); only
(c/w - 1)/(c - 1) of the ring's hops cross windows. Placement (head-first: a head group on
consecutive ranks; context-first: a context ring on consecutive ranks, Sec. 4 "device
placement") moves groups over links and leaves these figures unchanged.

Nothing here imports ``impls``; the rules are stated above.
"""
from __future__ import annotations

from fractions import Fraction

from . import comm
from .comm import Transfer, summarize
from .context import ULYSSES_AXIS, attention_traffic, gradient_allreduce, replica_states
from .prediction import RankPrediction
from .shape import Shape, require_positive_int

HEAD_AXIS = ULYSSES_AXIS
INNER_AXIS = "cp_inner"
OUTER_AXIS = "cp_outer"
PLACEMENTS = ("head-first", "context-first")


def check_grid(cp: int, cp_ulysses: int, cp_window: int) -> tuple[int, int, int]:
    """(u, c, w) of the grid, or ValueError naming the field, value and rule."""
    require_positive_int("cp_ulysses", cp_ulysses)
    require_positive_int("cp_window", cp_window)
    if cp % cp_ulysses:
        raise ValueError(f"cp_ulysses={cp_ulysses} does not divide cp={cp}")
    c = cp // cp_ulysses
    if c % cp_window:
        raise ValueError(f"cp_window={cp_window} does not divide the context ring size "
                         f"cp/cp_ulysses={c} (inner rings of cp_window ranks)")
    return cp_ulysses, c, cp_window


def loongtrain_traffic(b: int, s: int, h: int, cp: int, cp_ulysses: int = 1,
                       cp_window: int = 1, layers: int = 1, num_microbatches: int = 1,
                       bytes_per_element: int = 4, recompute: bool = False,
                       h_kv: int | None = None) -> list[Transfer]:
    """One rank's attention traffic per step (module doc), per group; ``h_kv``: K and V's
    width under grouped-query attention (default h)."""
    u, c, w = check_grid(cp, cp_ulysses, cp_window)
    if s % cp:
        raise ValueError(f"cp={cp} does not divide seq_length={s}")
    hk = h_kv or h
    e, lm = bytes_per_element, layers * num_microbatches
    out = comm.ulysses_traffic(b, s * u // cp, h, u, layers, num_microbatches, e,
                               recompute=recompute, axis=HEAD_AXIS, h_kv=hk)
    kv = 2 * b * (s // c) * (hk // u) * e
    fwd = 1 + int(recompute)
    windows = c // w
    for axis, size, hops in ((INNER_AXIS, w, windows * (w - 1)),
                             (OUTER_AXIS, windows, windows - 1)):
        if hops:
            out += [Transfer(axis, "send", size, kv, hops * lm * fwd, "K, V block (fwd)"),
                    Transfer(axis, "send", size, kv, hops * lm, "K, V block (bwd)"),
                    Transfer(axis, "send", size, kv, hops * lm, "dK, dV block (bwd)")]
    return out


def loongtrain_prediction(shape: Shape, *, cp: int, dp: int = 1, cp_ulysses: int = 1,
                          cp_window: int = 1, micro_batch_size: int, num_microbatches: int = 1,
                          recompute: str = "none", optimizer: str = "adamw",
                          elem_bytes: int = 4) -> RankPrediction:
    """Everything one rank measures in one step: the attention traffic per group, the
    gradient all-reduce over dp x cp and a whole replica's model states (as every native
    context-parallel scheme, ``analytic.context``)."""
    tr = loongtrain_traffic(micro_batch_size, shape.s, shape.h, cp, cp_ulysses, cp_window,
                            shape.l, num_microbatches, elem_bytes, recompute != "none",
                            h_kv=shape.kv_hidden)
    tr += gradient_allreduce(shape, cp, dp, elem_bytes)
    tr = [t for t in tr if t.count]
    return RankPrediction(tr, replica_states(shape, optimizer, elem_bytes),
                          {"transfers": [t.as_dict() for t in tr]})


def versus_usp(b: int, s: int, h: int, cp: int, cp_ulysses: int = 1, cp_window: int = 1,
               layers: int = 1, num_microbatches: int = 1, bytes_per_element: int = 4,
               recompute: bool = False, h_kv: int | None = None) -> dict:
    """LoongTrain's per-group wire bytes beside USP's on the same grid: the head group
    carries the same all-to-alls as USP's Ulysses group; the inner and outer rings together
    carry exactly USP's ring bytes (c - 1 hops either way); ``outer_hop_share`` is the
    fraction of ring hops that cross windows, (c/w - 1)/(c - 1), and ``steps_hiding_outer_hop``
    the inner steps each outer transfer overlaps (w; a single ring hides each hop behind one
    step); ``h_kv``: K and V's width under grouped-query attention, for both."""
    u, c, w = check_grid(cp, cp_ulysses, cp_window)
    mine = summarize(loongtrain_traffic(b, s, h, cp, u, w, layers, num_microbatches,
                                        bytes_per_element, recompute, h_kv=h_kv))
    usp = summarize(attention_traffic("usp", b, s, h, cp, u, layers, num_microbatches,
                                      bytes_per_element, recompute, h_kv=h_kv))

    def wire(tab, axis):
        return Fraction(tab[axis]["wire_bytes"]) if axis in tab else Fraction(0)

    head, inner, outer = (wire(mine, a) for a in (HEAD_AXIS, INNER_AXIS, OUTER_AXIS))
    usp_head, usp_ring = wire(usp, HEAD_AXIS), wire(usp, "cp_ring")
    return {"head_bytes": float(head), "inner_bytes": float(inner),
            "outer_bytes": float(outer), "total_bytes": float(head + inner + outer),
            "usp_ulysses_bytes": float(usp_head), "usp_ring_bytes": float(usp_ring),
            "usp_total_bytes": float(usp_head + usp_ring),
            "same_total_as_usp": head + inner + outer == usp_head + usp_ring,
            "outer_hop_share": float(Fraction(c // w - 1, c - 1)) if c > 1 else 0.0,
            "steps_hiding_outer_hop": w}
