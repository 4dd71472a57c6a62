"""Per-layer compute and communication costs for the time model: GEMM inventories at the
rank's local shapes priced by the profile, the layer's tensor/context/expert collectives
priced by alpha-beta per axis, recomputation."""
from __future__ import annotations

from dataclasses import dataclass, field

from .layout import Training
from .profile import Profile


# ---------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------

def _e(dtype: str) -> int:
    if dtype == "fp32":
        return 4
    if dtype in ("bf16", "fp16"):
        return 2
    raise ValueError(f"dtype={dtype!r} must be fp32, bf16 or fp16")


def _kv(shape) -> int:
    kv = getattr(shape, "kv_hidden", None)
    return int(kv) if kv else shape.h


def _gated(shape) -> bool:
    return bool(getattr(shape, "gated", False))


def _bias(shape) -> bool:
    return bool(getattr(shape, "bias", True))


def _vocab(shape, tp: int) -> int:
    pv = getattr(shape, "padded_vocab", None)
    v = pv(tp) if callable(pv) else -(-shape.V // tp) * tp
    return v // tp


def _param_shape(shape, tp: int):
    """``shape`` with its vocabulary padded to a multiple of tp (as the vocab-parallel layers
    pad it), for the parameter counts, which require tp | V."""
    v = _vocab(shape, tp) * tp
    if v == shape.V:
        return shape
    from dataclasses import replace
    return replace(shape, vocab_size=v)


def _cache(profile: Profile) -> dict:
    c = getattr(profile, "_tm_cache", None)
    if c is None:
        c = {}
        object.__setattr__(profile, "_tm_cache", c)
    return c


@dataclass
class _Costs:
    """One virtual stage's (or layer's) cost of one micro-batch: compute forward, backward
    for inputs and weights; exposed communication per axis forward / backward; the part of
    backward that is recomputation."""

    f: float = 0.0
    b: float = 0.0
    w: float = 0.0
    rc: float = 0.0
    comm_f: dict = field(default_factory=dict)
    comm_b: dict = field(default_factory=dict)

    def add(self, o: "_Costs", k: float = 1.0) -> None:
        self.f += k * o.f
        self.b += k * o.b
        self.w += k * o.w
        self.rc += k * o.rc
        for src, dst in ((o.comm_f, self.comm_f), (o.comm_b, self.comm_b)):
            for ax, v in src.items():
                dst[ax] = dst.get(ax, 0.0) + k * v

    @property
    def tf(self) -> float:
        return self.f + sum(self.comm_f.values())

    @property
    def tb(self) -> float:
        return self.b + self.rc + sum(self.comm_b.values())


def _comm_time(profile: Profile, transfers, link: str) -> float:
    return sum(t.count * profile.collective_time(t.op, t.group_size, t.message_bytes, link)
               for t in transfers if t.count)


# ---------------------------------------------------------------------------------------
# one layer
# ---------------------------------------------------------------------------------------

def layer_costs(shape, trn: Training, profile: Profile, moe_layer: bool = False) -> _Costs:
    """One transformer layer, one micro-batch, one rank: compute (f, b, w, recompute) and
    the exposed tp / cp / ep communication (module doc)."""
    lay, opt = trn.layout, trn.options
    key = ("layer", shape, lay.tp, lay.cp, lay.ep, lay.etp, opt.tensor.sp, opt.recompute,
           lay.micro_batch_size, trn.dtype, opt.context.cp_algorithm,
           opt.context.cp_ulysses, moe_layer, trn.ranks_per_node)
    cache = _cache(profile)
    hit = cache.get(key)
    if hit is not None:
        return hit
    c = _layer_costs(shape, trn, profile, moe_layer)
    cache[key] = c
    return c


def _gemms(profile: Profile, m: int, n_out: int, k_in: int, dt: str) -> tuple[float, float,
                                                                                float]:
    """Forward, input-gradient and weight-gradient GEMMs of a linear k_in -> n_out on m rows."""
    return (profile.gemm_time(m, n_out, k_in, dt), profile.gemm_time(m, k_in, n_out, dt),
            profile.gemm_time(n_out, k_in, m, dt))


def _dense_inventory(profile: Profile, b: int, s_l: int, h: int, a_l: int, f_l: int,
                     kv_l: int, gated: bool, bias: bool, tp: int, T_ln: int, dt: str  # noqa: N803
                     ) -> tuple[float, float, float, float, float]:
    """The operator count of one dense layer at a rank's local shape, causal self-attention
    over its own s_l tokens: (forward, backward-input, backward-weight, attention forward,
    attention backward) seconds."""
    e = _e(dt)
    T = b * s_l  # noqa: N806
    d = h // (max(a_l, 1) * tp)  # the head dimension h / a
    f = b_ = w = 0.0
    linears = [(a_l * d + 2 * kv_l, h), (h, a_l * d), (f_l * (2 if gated else 1), h), (h, f_l)]
    for n_out, k_in in linears:
        g = _gemms(profile, T, n_out, k_in, dt)
        f += g[0]
        b_ += g[1]
        w += g[2]
    af, ab = profile.attention_time(b, a_l, s_l, s_l, d, dt, True)
    f += af
    b_ += ab
    norm_b = 2 * T_ln * h * e
    act_b = (5 if gated else 2) * T * f_l * e
    resid_b = 3 * T_ln * h * e
    views = 6
    extra_tp = 2 if tp > 1 else 0
    f += profile.mem_time(2 * norm_b + 2 * resid_b + act_b, 5 + int(gated) + views + extra_tp)
    params_per_layer = 12 if bias else 7
    bias_b = sum(T * n for n, _ in linears) * e if bias else 0.0
    b_ += profile.mem_time(1.5 * (2 * norm_b + act_b) + 2 * resid_b, 0) \
        + (9 + int(gated) + views + extra_tp) * profile.bwd_op_overhead_s \
        + 6 * profile.op_overhead_s
    w += profile.mem_time(bias_b, 0) + params_per_layer * profile.bwd_op_overhead_s
    return f, b_, w, af, ab


def _part_ratio(profile: Profile, kind: str, dt: str) -> tuple[float, float]:
    """Median (measured / operator count) of the parts ``calibrate`` timed, forward and
    backward: how far this machine's eager overheads are from the count (1, 1 if none)."""
    key = ("ratio", kind, dt)
    cache = _cache(profile)
    if key in cache:
        return cache[key]
    rf, rb = [], []
    for p in profile.parts:
        if p["kind"] != kind or p["dtype"] != dt:
            continue
        if kind == "layer":
            f, b_, w, _, _ = _dense_inventory(profile, p["b"], p["s"], p["h"], p["heads"],
                                              p["f"], p["kv"], bool(p.get("gated")), True,
                                              p.get("tp", 1), p["b"] * p["s"], dt)
        else:
            f, b_, w = _ends_inventory(profile, p["b"] * p["s"], p["h"], p["vocab"], dt)
        if f > 0:
            rf.append(p["fwd_s"] / f)
        if b_ + w > 0:
            rb.append(p["bwd_s"] / (b_ + w))
    med = lambda xs: sorted(xs)[len(xs) // 2] if xs else 1.0  # noqa: E731
    cache[key] = (med(rf), med(rb))
    return cache[key]


def _apply_measured(profile: Profile, kind: str, dt: str, inv: tuple[float, float, float],
                    measured: tuple[float, float] | None) -> tuple[float, float, float]:
    """(f, b, w): the measured part when there is one (backward split into input and weight
    parts as the operator count splits it), else the count scaled by the machine's ratio."""
    f, b_, w = inv
    if measured is None:
        rf, rb = _part_ratio(profile, kind, dt)
        return f * rf, b_ * rb, w * rb
    mf, mb = measured
    share = w / (b_ + w) if b_ + w > 0 else 0.0
    return mf, mb * (1 - share), mb * share


def _layer_costs(shape, trn: Training, profile: Profile, moe_layer: bool) -> _Costs:
    lay, opt = trn.layout, trn.options
    from ..analytic import comm as acomm
    tp, cp, b, dt = lay.tp, lay.cp, lay.micro_batch_size, trn.dtype
    e = _e(dt)
    h, f, a = shape.h, shape.f, shape.a
    s_l = shape.s // cp
    T = b * s_l  # noqa: N806
    T_ln = T // tp if (opt.tensor.sp and tp > 1) else T  # noqa: N806
    kv_l = max(_kv(shape) // tp, 1)
    d = h // a
    a_l = max(a // tp, 1)
    gated = _gated(shape)
    bias = _bias(shape)
    c = _Costs()
    inv = _dense_inventory(profile, b, s_l, h, a_l, f // tp, kv_l, gated, bias, tp, T_ln, dt)
    f0, b0, w0, af_self, ab_self = inv
    if moe_layer:
        # the dense MLP's share replaced by the router and the local experts
        E, k = shape.num_experts, shape.moe_top_k  # noqa: N806
        etp = lay.etp or tp
        ep = lay.ep
        rows = max(1, int(round(k * T_ln * (shape.moe_capacity_factor or 1.0))))
        per_expert = max(1, -(-rows * ep // E))
        n_local = max(1, E // ep)
        for n_out, k_in in ((f // tp * (2 if gated else 1), h), (h, f // tp)):
            g = _gemms(profile, T, n_out, k_in, dt)
            f0, b0, w0 = f0 - g[0], b0 - g[1], w0 - g[2]
        router = _gemms(profile, T_ln, E, h, dt)
        f0, b0, w0 = f0 + router[0], b0 + router[1], w0 + router[2]
        for n_out, k_in in ((f // etp * (2 if gated else 1), h), (h, f // etp)):
            g = _gemms(profile, per_expert, n_out, k_in, dt)
            f0, b0, w0 = f0 + n_local * g[0], b0 + n_local * g[1], w0 + n_local * g[2]
        route_bytes = 6 * rows * h * e + 3 * T_ln * E * 4
        f0 += profile.mem_time(route_bytes, 8)
        b0 += profile.mem_time(route_bytes, 8) + 8 * profile.bwd_op_overhead_s
        measured = None
    else:
        measured = profile.part_time("layer", b=b, s=s_l, h=h, heads=a_l, f=f // tp, kv=kv_l,
                                     dtype=dt, gated=gated)
    c.f, c.b, c.w = _apply_measured(profile, "layer", dt, (f0, b0, w0), measured)
    # ---- attention under context parallelism: replace the local causal kernel
    kind = opt.context.cp_algorithm
    hop_block = 0.0
    if cp == 1:
        af, ab = af_self, ab_self
    else:
        if kind == "ulysses":
            af, ab = profile.attention_time(b, max(a_l // cp, 1), shape.s, shape.s, d, dt,
                                            True)
        elif kind == "allgather":
            af, ab = profile.attention_time(b, a_l, s_l, shape.s, d, dt, False)
            af, ab = 0.5 * (af + profile.op_overhead_s), 0.5 * (ab + profile.op_overhead_s)
        else:  # ring attention (and RSA, USP's ring): cp causal blocks of s_l x s_l
            bf, bb = af_self, ab_self
            merge = profile.mem_time(4 * T * (h // tp) * e, 4)
            af, ab = cp * bf + (cp - 1) * merge, cp * bb + (cp - 1) * merge
            hop_block = bf
        rf, rb = _part_ratio(profile, "layer", dt)
        c.f += max(af - af_self, 0.0) * rf
        c.b += max(ab - ab_self, 0.0) * rb
    # ---- recomputation
    if opt.recompute == "full":
        c.rc = c.f
    elif opt.recompute == "selective":
        c.rc = af * _part_ratio(profile, "layer", dt)[0]
    # ---- communication on the critical path
    rpn = trn.ranks_per_node or profile.ranks_per_node
    prof_link = _LinkFn(profile, rpn)
    if tp > 1:
        from ..analytic import tensor as atensor
        sp = opt.tensor.sp
        fwd_tr = atensor.megatron_layer_traffic(b, s_l, h, tp, "none", sp, e)
        full_tr = atensor.megatron_layer_traffic(b, s_l, h, tp, opt.recompute, sp, e)
        link = prof_link(1, tp)
        # forward: half of the no-recompute count (2 of 4 all-reduces; 2 AG + 2 RS of SP's)
        t_all = _comm_time(profile, fwd_tr, link)
        t_full = _comm_time(profile, full_tr, link)
        if opt.tensor.sp:
            t_f = _comm_time(profile, [_scaled(t, 2 / t.count) for t in fwd_tr], link)
        else:
            t_f = t_all / 2
        c.comm_f["tp"] = t_f
        c.comm_b["tp"] = t_full - t_f
    if cp > 1:
        from ..analytic import context as actx
        link = prof_link(tp, cp)
        tr = actx.attention_traffic(kind, b, shape.s, h // tp, cp,
                                    opt.context.cp_ulysses, 1, 1, e,
                                    opt.recompute != "none")
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
    if moe_layer and lay.ep > 1:
        E, k = shape.num_experts, shape.moe_top_k  # noqa: N806
        cf = shape.moe_capacity_factor or None
        tr = acomm.expert_traffic(T_ln, h, lay.ep, 1, 1, k, e, opt.recompute == "full",
                                  capacity_factor=cf, num_experts=E)
        link = prof_link(lay.etp or tp, lay.ep)
        t_all = _comm_time(profile, tr, link)
        n_all = sum(t.count for t in tr) or 1
        c.comm_f["ep"] = t_all * 2 / n_all
        c.comm_b["ep"] = t_all - c.comm_f["ep"]
    return c


def _scaled(t, k: float):
    from ..analytic.comm import Transfer
    return Transfer(t.axis, t.op, t.group_size, t.message_bytes, max(1, int(round(t.count * k))),
                    t.what)


class _LinkFn:
    def __init__(self, profile: Profile, ranks_per_node: int):
        self.profile, self.rpn = profile, ranks_per_node

    def __call__(self, stride: int, size: int) -> str:
        if "inter" not in self.profile.links and "inter" not in self.profile.collectives:
            return "intra"
        return "intra" if stride * size <= self.rpn else "inter"


def _ends_inventory(profile: Profile, T: int, h: int, vl: int, dt: str  # noqa: N803
                    ) -> tuple[float, float, float]:
    hf, hb, hw = _head_inventory(profile, T, h, vl, 1, dt)
    ef, eb, ew = _embed_inventory(profile, T, h, vl, 1, dt, True)
    return hf + ef, hb + eb + profile.backward_call_s, hw + ew


def _head_inventory(profile: Profile, T: int, h: int, vl: int, tp: int, dt: str  # noqa: N803
                    ) -> tuple[float, float, float]:
    """Final norm, LM head GEMMs and the cross-entropy of T tokens (vocab-parallel: more
    elementwise operators)."""
    e = _e(dt)
    g = _gemms(profile, T, vl, h, dt)
    logits = T * vl
    ce_ops = 4 if tp == 1 else 12  # vocab-parallel: max, subtract, exp, sum, target, ...
    f = g[0] + profile.mem_time(2 * T * h * e + logits * (e + 3 * 4), 2 + ce_ops)
    b_ = g[1] + profile.mem_time(3 * logits * 4 + 3 * T * h * e, 0) \
        + (3 + ce_ops) * profile.bwd_op_overhead_s
    w = g[2] + 3 * profile.bwd_op_overhead_s + profile.mem_time(T * h * e, 0)
    return f, b_, w


def _embed_inventory(profile: Profile, T: int, h: int, vl: int, tp: int, dt: str,  # noqa: N803
                     pos: bool) -> tuple[float, float, float]:
    """Token lookup (and position add) forward; scatter-add of the token gradient into a
    zeroed V/tp x h buffer, position gradient, backward."""
    e = _e(dt)
    f = profile.mem_time(T * h * e * (4 if pos else 1), 3 + (2 if tp > 1 else 0))
    w = profile.mem_time(vl * h * 4 + 2 * T * h * e, 2) + \
        (4 if pos else 2) * profile.bwd_op_overhead_s
    return f, 0.0, w
