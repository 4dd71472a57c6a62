"""The time model's cost record and pricing helpers: ``_Costs`` (a stage's or a layer's cost
of one micro-batch), the GEMM and operator inventories of a layer and of the model's ends at
the rank's local shapes priced by the profile, collectives priced by alpha-beta per axis.
``transformer_layer`` prices one layer with them."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..analytic.comm import Transfer
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

    def copy(self) -> "_Costs":
        return _Costs(self.f, self.b, self.w, self.rc, dict(self.comm_f), dict(self.comm_b))

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

def _gemms(profile: Profile, m: int, n_out: int, k_in: int, dt: str) -> tuple[float, float,
                                                                                float]:
    """Forward, input-gradient and weight-gradient GEMMs of a linear k_in -> n_out on m rows."""
    return (profile.gemm_time(m, n_out, k_in, dt), profile.gemm_time(m, k_in, n_out, dt),
            profile.gemm_time(n_out, k_in, m, dt))


def _dense_inventory(profile: Profile, b: int, s_l: int, h: int, a_l: int, f_l: int,
                     kv_l: int, gated: bool, bias: bool, tp: int, T_ln: int, dt: str,  # noqa: N803
                     fused: bool = True, mla: tuple | None = None
                     ) -> tuple[float, float, float, float, float]:
    """The operator count of one dense layer at a rank's local shape, causal self-attention
    over its own s_l tokens (``fused``: a flash kernel, else unfused, as
    :meth:`Profile.attention_time` prices them): (forward, backward-input, backward-weight,
    attention forward, attention backward) seconds. ``mla``: multi-head latent attention's
    (projections as (n_out, k_in), attention head dimension) instead of QKV and the output
    projection (``mla_gemms``)."""
    e = _e(dt)
    T = b * s_l  # noqa: N806
    d = h // (max(a_l, 1) * tp)  # the head dimension h / a
    f = b_ = w = 0.0
    attn = [(a_l * d + 2 * kv_l, h), (h, a_l * d)]
    if mla is not None:
        attn, d = mla
    linears = attn + [(f_l * (2 if gated else 1), h), (h, f_l)]
    for n_out, k_in in linears:
        g = _gemms(profile, T, n_out, k_in, dt)
        f += g[0]
        b_ += g[1]
        w += g[2]
    af, ab = profile.attention_time(b, a_l, s_l, s_l, d, dt, True, fused)
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


def _scaled(t, k: float):
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


def mla_gemms(shape, tp: int) -> tuple[list[tuple[int, int]], float]:
    """Multi-head latent attention on one tensor-parallel rank as GEMMs (n_out, k_in): the
    down projections to the latents whole, the up projections and the output projection
    over a / t heads (``analytic.params.mla_linears``); and the head dimension that prices
    the attention kernel, (d_qk + d_v) / 2 (QK^T over d_qk, AV over d_v)."""
    a_l = max(shape.a // tp, 1)
    d_nope = shape.qk_head_dim or shape.head_dim
    d_qk, d_v = d_nope + shape.qk_rope_head_dim, shape.v_head_dim or shape.head_dim
    dq, dc, h = shape.q_lora_rank, shape.kv_lora_rank, shape.h
    q = [(dq, h), (a_l * d_qk, dq)] if dq else [(a_l * d_qk, h)]
    return (q + [(dc + shape.qk_rope_head_dim, h), (a_l * (d_nope + d_v), dc), (h, a_l * d_v)],
            (d_qk + d_v) / 2)


@dataclass(frozen=True)
class MoeLocal:
    """A MoE layer's expert work on one rank: ``rows`` routed rows in all (k T_ln tokens,
    capacity-scaled), ``per_expert`` of them on each of the rank's ``n_local`` = E / ep
    experts (the rows spread over the E experts, ep groups each holding all of them), the
    local expert width ``fe`` (``expert_f`` / etp) and the shared experts' local width
    ``shared`` (0: none)."""

    rows: int
    per_expert: int
    n_local: int
    fe: int
    shared: int


def moe_local(shape, ep: int, etp: int, tp: int, T_ln: int) -> MoeLocal:  # noqa: N803
    """The rank's share of a MoE layer (:class:`MoeLocal`), as the layer's price and the
    selective recomputation of its modules both count it."""
    E = shape.num_experts  # noqa: N806
    rows = max(1, int(round(shape.moe_top_k * T_ln * (shape.moe_capacity_factor or 1.0))))
    return MoeLocal(rows=rows, per_expert=max(1, -(-rows * ep // E)), n_local=max(1, E // ep),
                    fe=getattr(shape, "expert_f", shape.f) // etp,
                    shared=getattr(shape, "moe_shared_expert_size", 0) // tp)

