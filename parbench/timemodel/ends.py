"""The embedding and LM-head costs of the first and last pipeline stages (time model)."""
from __future__ import annotations

from ..analytic import comm as acomm
from .costs import (
    _cache,
    _comm_time,
    _Costs,
    _e,
    _embed_inventory,
    _gated,
    _head_inventory,
    _kv,
    _LinkFn,
    _part_ratio,
    _vocab,
)
from .training import Training
from .profile import Profile

# ---------------------------------------------------------------------------------------
# embedding, head
# ---------------------------------------------------------------------------------------







def _ends(shape, trn: Training, profile: Profile) -> tuple[_Costs, _Costs]:
    """(embedding, head) of one micro-batch; the head carries the loss and the micro-batch's
    ``backward()`` call. Where ``calibrate`` timed the ends at this local shape, their sum is
    the measured one, split between the two as the operator count splits it."""
    lay, opt = trn.layout, trn.options
    key = ("ends", shape, lay.tp, lay.cp, opt.tensor.sp, lay.micro_batch_size, trn.dtype,
           trn.ranks_per_node)
    cache = _cache(profile)
    if key in cache:
        return cache[key]
    tp, dt = lay.tp, trn.dtype
    e = _e(dt)
    b, s_l, h = lay.micro_batch_size, shape.s // lay.cp, shape.h
    T = b * s_l  # noqa: N806
    vl = _vocab(shape, tp)
    pos = bool(getattr(shape, "position_embeddings", True))
    hf, hb, hw = _head_inventory(profile, T, h, vl, tp, dt)
    hb += profile.backward_call_s
    ef, eb, ew = _embed_inventory(profile, T, h, vl, tp, dt, pos)
    measured = profile.part_time("ends", b=b, s=s_l, h=h, heads=max(shape.a // tp, 1),
                                 f=shape.f // tp, kv=max(_kv(shape) // tp, 1), vocab=vl,
                                 dtype=dt, gated=_gated(shape))
    inv_f, inv_b = hf + ef, hb + hw + eb + ew
    if measured is not None:
        rf = measured[0] / inv_f if inv_f > 0 else 1.0
        rb = measured[1] / inv_b if inv_b > 0 else 1.0
    else:
        rf, rb = _part_ratio(profile, "ends", dt)
    head = _Costs(f=hf * rf, b=hb * rb, w=hw * rb)
    emb = _Costs(f=ef * rf, b=eb * rb, w=ew * rb)
    if tp > 1:
        link = _LinkFn(profile, trn.ranks_per_node or profile.ranks_per_node)(1, tp)
        S = T * h * e  # noqa: N806
        ce = acomm.Transfer("tp", "all_reduce", tp, T * 4, 3)
        if opt.tensor.sp:
            fwd = [acomm.Transfer("tp", "all_gather", tp, S, 1), ce]
            bwd = [acomm.Transfer("tp", "all_gather", tp, S, 1),
                   acomm.Transfer("tp", "reduce_scatter", tp, S, 1)]
            emb.comm_f["tp"] = profile.collective_time("reduce_scatter", tp, S, link)
            emb.comm_b["tp"] = profile.collective_time("all_gather", tp, S, link)
        else:
            fwd = [ce]
            bwd = [acomm.Transfer("tp", "all_reduce", tp, S, 1)]
            emb.comm_f["tp"] = profile.collective_time("all_reduce", tp, S, link)
        head.comm_f["tp"] = _comm_time(profile, fwd, link)
        head.comm_b["tp"] = _comm_time(profile, bwd, link)
    cache[key] = (emb, head)
    return emb, head
