"""One transformer layer priced for the time model: one micro-batch on one rank, its compute
(forward, input- and weight-gradient GEMMs, the attention kernel under context parallelism,
recomputation) and its exposed tensor / context / expert communication (``model``'s module
doc states the rules; ``costs`` holds the inventories and pricing helpers)."""
from __future__ import annotations

from dataclasses import dataclass

from ..analytic import comm as acomm
from ..analytic import context as actx
from ..analytic import gqa as agqa
from ..analytic import tensor as atensor
from ..analytic.recompute_modules import repeats_dispatch
from .costs import (
    _apply_measured,
    _bias,
    _cache,
    _comm_time,
    _Costs,
    _dense_inventory,
    _e,
    _gated,
    _gemms,
    _kv,
    _LinkFn,
    _part_ratio,
    _scaled,
    mla_gemms,
    moe_local,
)
from .recompute import selective_forward_s
from .training import Training
from .profile import Profile


def layer_costs(shape, trn: Training, profile: Profile, moe_layer: bool = False) -> _Costs:
    """One transformer layer, one micro-batch, one rank: compute (f, b, w, recompute) and
    the exposed tp / cp / ep communication (``model``'s module doc)."""
    lay, opt = trn.layout, trn.options
    key = ("layer", shape, lay.tp, lay.cp, lay.ep, lay.etp, opt.tensor.sp, opt.recompute,
           opt.recompute_modules,
           lay.micro_batch_size, trn.dtype, opt.context.cp_algorithm,
           opt.context.cp_ulysses, moe_layer, trn.ranks_per_node, trn.attention)
    cache = _cache(profile)
    hit = cache.get(key)
    if hit is not None:
        return hit
    c = _layer_costs(shape, trn, profile, moe_layer)
    cache[key] = c
    return c


def _local_kv_width(shape, tp: int) -> int:
    """One tensor-parallel rank's key (or value) width: its share of the K/V heads, at least
    one whole head -- when tp exceeds the heads each of the tp / num_kv_heads ranks of a
    query group holds that head's activations (Megatron-Core gathers the QKV output:
    ``analytic.gqa``)."""
    d = shape.h // shape.a
    return max(_kv(shape) // d // tp, 1) * d


def fused_attention(trn: Training, profile: Profile) -> bool:
    """Whether the attention core is priced as one fused (flash) kernel: ``attention=flash``,
    or a calibrated profile (it timed parbench's own model, which runs PyTorch's fused
    ``scaled_dot_product_attention``); ``attention=eager`` on a preset prices the unfused
    core (Megatron before flash attention)."""
    return trn.attention == "flash" or profile.calibrated


@dataclass(frozen=True)
class _LocalLayer:
    """One layer's shape on one rank: b sequences of s_l = s / cp tokens (T rows; T_ln in
    the norms and residuals, T / tp under sequence parallelism), a_l of the a heads of width
    d, kv_l of the key-value width, in dtype dt of e bytes an element."""

    tp: int
    cp: int
    b: int
    s_l: int
    T: int  # noqa: N815
    T_ln: int  # noqa: N815
    h: int
    a_l: int
    d: int
    kv_l: int
    gated: bool
    bias: bool
    dt: str
    e: int
    fused: bool

    @classmethod
    def of(cls, shape, trn: Training, profile: Profile) -> _LocalLayer:
        lay = trn.layout
        tp, cp, b = lay.tp, lay.cp, lay.micro_batch_size
        s_l = shape.s // cp
        T = b * s_l  # noqa: N806
        T_ln = T // tp if (trn.options.tensor.sp and tp > 1) else T  # noqa: N806
        return cls(tp=tp, cp=cp, b=b, s_l=s_l, T=T, T_ln=T_ln, h=shape.h,
                   a_l=max(shape.a // tp, 1), d=shape.h // shape.a,
                   kv_l=_local_kv_width(shape, tp), gated=_gated(shape), bias=_bias(shape),
                   dt=trn.dtype, e=_e(trn.dtype), fused=fused_attention(trn, profile))


def _layer_costs(shape, trn: Training, profile: Profile, moe_layer: bool) -> _Costs:
    """One layer's costs (``layer_costs``): its compute, attention under context
    parallelism, recomputation, then the exposed tp / cp / ep communication."""
    lay = trn.layout
    loc = _LocalLayer.of(shape, trn, profile)
    c = _Costs()
    af_self, ab_self = _layer_compute(c, shape, trn, profile, loc, moe_layer)
    af, hop_block = _cp_attention(c, shape, trn, profile, loc, af_self, ab_self)
    _recomputation(c, trn, profile, selective_forward_s(shape, trn, profile, loc, moe_layer,
                                                        af)
                   if trn.options.recompute == "selective" else 0.0)
    # ---- communication on the critical path
    link = _LinkFn(profile, trn.ranks_per_node or profile.ranks_per_node)
    if loc.tp > 1:
        _tp_comm(c, trn, profile, loc, link(1, loc.tp))
        _gqa_comm(c, shape, trn, profile, loc, link(1, loc.tp))
    if loc.cp > 1:
        _cp_comm(c, shape, trn, profile, loc, link(loc.tp, loc.cp), hop_block)
    if moe_layer and lay.ep > 1:
        _ep_comm(c, shape, trn, profile, loc, link(lay.etp or loc.tp, lay.ep))
    return c


def _layer_compute(c: _Costs, shape, trn: Training, profile: Profile, loc: _LocalLayer,
                   moe_layer: bool) -> tuple[float, float]:
    """The layer's forward, input- and weight-gradient compute into ``c`` (the measured
    layer when ``calibrate`` timed this shape); returns the local causal attention kernel's
    (forward, backward) seconds."""
    f_l = shape.f // loc.tp
    mla = mla_gemms(shape, loc.tp) if getattr(shape, "mla", False) else None
    inv = _dense_inventory(profile, loc.b, loc.s_l, loc.h, loc.a_l, f_l, loc.kv_l, loc.gated,
                           loc.bias, loc.tp, loc.T_ln, loc.dt, loc.fused, mla)
    f0, b0, w0, af_self, ab_self = inv
    if moe_layer:
        f0, b0, w0 = _moe_mlp(shape, trn, profile, loc, f0, b0, w0)
        measured = None
    else:
        measured = profile.part_time("layer", b=loc.b, s=loc.s_l, h=loc.h, heads=loc.a_l,
                                     f=f_l, kv=loc.kv_l, dtype=loc.dt, gated=loc.gated)
    c.f, c.b, c.w = _apply_measured(profile, "layer", loc.dt, (f0, b0, w0), measured)
    return af_self, ab_self


def _moe_mlp(shape, trn: Training, profile: Profile, loc: _LocalLayer, f0: float, b0: float,
             w0: float) -> tuple[float, float, float]:
    """(f, b, w) of a dense layer's count with its MLP replaced by the router and the local
    experts (k T capacity-scaled rows spread over the E / ep experts of the rank, each of
    hidden size ``expert_f``), and the shared experts' MLP on every token."""
    E = shape.num_experts  # noqa: N806
    h, f, tp, T, T_ln, dt = shape.h, shape.f, loc.tp, loc.T, loc.T_ln, loc.dt  # noqa: N806
    gated = loc.gated
    mo = moe_local(shape, trn.layout.ep, trn.layout.etp or tp, tp, T_ln)
    for n_out, k_in in ((f // tp * (2 if gated else 1), h), (h, f // tp)):
        g = _gemms(profile, T, n_out, k_in, dt)
        f0, b0, w0 = f0 - g[0], b0 - g[1], w0 - g[2]
    router = _gemms(profile, T_ln, E, h, dt)
    f0, b0, w0 = f0 + router[0], b0 + router[1], w0 + router[2]
    for n_out, k_in in ((mo.fe * (2 if gated else 1), h), (h, mo.fe)):
        g = _gemms(profile, mo.per_expert, n_out, k_in, dt)
        f0, b0, w0 = f0 + mo.n_local * g[0], b0 + mo.n_local * g[1], w0 + mo.n_local * g[2]
    if mo.shared:  # DeepSeekMoE's shared experts: a dense MLP on every token of the rank
        for n_out, k_in in ((mo.shared * (2 if gated else 1), h), (h, mo.shared)):
            g = _gemms(profile, T, n_out, k_in, dt)
            f0, b0, w0 = f0 + g[0], b0 + g[1], w0 + g[2]
    route_bytes = 6 * mo.rows * h * loc.e + 3 * T_ln * E * 4
    f0 += profile.mem_time(route_bytes, 8)
    b0 += profile.mem_time(route_bytes, 8) + 8 * profile.bwd_op_overhead_s
    return f0, b0, w0


def _cp_attention(c: _Costs, shape, trn: Training, profile: Profile, loc: _LocalLayer,
                  af_self: float, ab_self: float) -> tuple[float, float]:
    """Attention under context parallelism: the local causal kernel in ``c`` replaced by
    Ulysses' (all heads' share over the whole sequence), all-gather CP's (the local queries
    over all keys) or ring attention's (cp causal blocks, merged). Returns the attention's
    forward seconds and the block one ring hop overlaps (0 without a ring)."""
    if loc.cp == 1:
        return af_self, 0.0
    b, cp, d, dt = loc.b, loc.cp, loc.d, loc.dt
    kind = trn.options.context.cp_algorithm
    hop_block = 0.0
    if kind == "ulysses":
        af, ab = profile.attention_time(b, max(loc.a_l // cp, 1), shape.s, shape.s, d, dt,
                                        True, loc.fused)
    elif kind == "allgather":
        af, ab = profile.attention_time(b, loc.a_l, loc.s_l, shape.s, d, dt, False,
                                        loc.fused)
        af, ab = 0.5 * (af + profile.op_overhead_s), 0.5 * (ab + profile.op_overhead_s)
    else:  # ring attention (and RSA, USP's ring): cp causal blocks of s_l x s_l
        bf, bb = af_self, ab_self
        merge = profile.mem_time(4 * loc.T * (loc.h // loc.tp) * loc.e, 4)
        af, ab = cp * bf + (cp - 1) * merge, cp * bb + (cp - 1) * merge
        hop_block = bf
    rf, rb = _part_ratio(profile, "layer", dt)
    c.f += max(af - af_self, 0.0) * rf
    c.b += max(ab - ab_self, 0.0) * rb
    return af, hop_block


def _recomputation(c: _Costs, trn: Training, profile: Profile, selective_f: float) -> None:
    """Recomputation (Korthikanti et al. 2022, Sec. 5): ``full`` repeats the layer's
    forward, ``selective`` its modules' forward (``selective_f`` seconds: the attention core
    by default, ``recompute.selective_forward_s``)."""
    if trn.options.recompute == "full":
        c.rc = c.f
    elif trn.options.recompute == "selective":
        c.rc = selective_f * _part_ratio(profile, "layer", trn.dtype)[0]


def _tp_comm(c: _Costs, trn: Training, profile: Profile, loc: _LocalLayer, link: str) -> None:
    """Tensor parallelism's collectives (Megatron's all-reduces, or sequence parallelism's
    all-gathers and reduce-scatters), exposed: forward half of the no-recompute count,
    backward the rest with what recomputation repeats."""
    sp = trn.options.tensor.sp
    b, s_l, h, tp, e = loc.b, loc.s_l, loc.h, loc.tp, loc.e
    fwd_tr = atensor.megatron_layer_traffic(b, s_l, h, tp, "none", sp, e)
    full_tr = atensor.megatron_layer_traffic(b, s_l, h, tp, trn.options.recompute, sp, e)
    # forward: half of the no-recompute count (2 of 4 all-reduces; 2 AG + 2 RS of SP's)
    t_all = _comm_time(profile, fwd_tr, link)
    t_full = _comm_time(profile, full_tr, link)
    if sp:
        t_f = _comm_time(profile, [_scaled(t, 2 / t.count) for t in fwd_tr], link)
    else:
        t_f = t_all / 2
    c.comm_f["tp"] = t_f
    c.comm_b["tp"] = t_full - t_f


def _gqa_comm(c: _Costs, shape, trn: Training, profile: Profile, loc: _LocalLayer,
              link: str) -> None:
    """With tp > num_kv_heads, the QKV output's all-gather (forward; again under full
    recompute, in backward) and its gradient's reduce-scatter (backward), exposed
    (Megatron-Core's GQA split: ``analytic.gqa``)."""
    full = agqa.qkv_gather_transfers(shape, loc.b, loc.s_l, loc.tp, trn.options.recompute,
                                     loc.e)
    if not full:
        return
    t_f = _comm_time(profile, [_scaled(full[0], 1 / full[0].count)], link)
    c.comm_f["tp"] = c.comm_f.get("tp", 0.0) + t_f
    c.comm_b["tp"] = c.comm_b.get("tp", 0.0) + _comm_time(profile, full, link) - t_f


def _cp_comm(c: _Costs, shape, trn: Training, profile: Profile, loc: _LocalLayer, link: str,
             hop_block: float) -> None:
    """Context parallelism's traffic: ring hops less the block each overlaps; Ulysses'
    all-to-alls and all-gather CP's gathers exposed."""
    kind, opt = trn.options.context.cp_algorithm, trn.options
    tr = actx.attention_traffic(kind, loc.b, shape.s, loc.h // loc.tp, loc.cp,
                                opt.context.cp_ulysses, 1, 1, loc.e,
                                opt.recompute != "none", h_kv=loc.kv_l)
    if kind in ("ring-attention", "ring-self-attention", "usp"):
        # each hop overlaps the block computed meanwhile (Liu et al. 2023, Sec. 3)
        sends = [t for t in tr if t.op == "send"]
        hop_t = max((profile.collective_time("send", 2, t.message_bytes, link)
                     for t in sends), default=0.0)
        hide = 0.0 if profile.p2p_blocking else profile.overlap * hop_block
        per_hop = max(0.0, hop_t - hide)
        hops_f = sum(t.count for t in sends if "fwd" in t.what)
        hops_b = sum(t.count for t in sends if "fwd" not in t.what)
        c.comm_f["cp"] = hops_f * per_hop
        c.comm_b["cp"] = hops_b * per_hop + _comm_time(
            profile, [t for t in tr if t.op != "send"], link)
    else:
        # Ulysses (4 all-to-alls forward of 8 or 12) and all-gather CP (K, V gathered
        # forward: 2 of the gathers), exposed
        t_all = _comm_time(profile, tr, link)
        n_all = sum(t.count for t in tr) or 1
        n_f = 4 if kind == "ulysses" else 2
        c.comm_f["cp"] = t_all * n_f / n_all
        c.comm_b["cp"] = t_all - c.comm_f["cp"]


def _ep_comm(c: _Costs, shape, trn: Training, profile: Profile, loc: _LocalLayer,
             link: str) -> None:
    """Expert parallelism's dispatch and combine all-to-alls (Lepikhin et al. 2020),
    exposed: 2 forward, the rest (and full recomputation's repeat) backward."""
    opt = trn.options
    cf = shape.moe_capacity_factor or None
    tr = acomm.expert_traffic(loc.T_ln, loc.h, trn.layout.ep, 1, 1, shape.moe_top_k, loc.e,
                              repeats_dispatch(opt), capacity_factor=cf,
                              num_experts=shape.num_experts)
    t_all = _comm_time(profile, tr, link)
    n_all = sum(t.count for t in tr) or 1
    c.comm_f["ep"] = t_all * 2 / n_all
    c.comm_b["ep"] = t_all - c.comm_f["ep"]
