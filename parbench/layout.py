"""The parallel layout: one frozen record of the degrees, the rank grid, and every rule.

Modelled on torchtitan's ``ParallelDims``: one record names how many ranks each kind of
parallelism takes; every other part of parbench (the mesh, the schemes, the closed forms, the
time model, the planner, case ids, rows and reports) takes a :class:`Layout` instead of
spelling the degrees out again.

Rank order follows Megatron-Core exactly (``parallel_state.RankGenerator``): tensor
parallelism fastest and pipeline slowest, tp-cp-ep-dp-pp. For the dense part of the model ep
is 1, so world = tp x cp x dp x pp. Expert parallelism does not add a factor to the world: the
tp x cp x dp ranks of each pipeline stage are re-partitioned as expert-tp x ep x expert-dp
(order etp-ep-edp-pp). A group over a set of axes holds the ranks that share every *other*
coordinate, listed with the first named axis fastest (Megatron's
``generate_masked_orthogonal_rank_groups``).

The divisibility rules are stated once, here, and raise :class:`ConfigError` naming the
field, the value and the rule. This module is pure: no torch, no other parbench module.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from enum import StrEnum
from itertools import product
from typing import Any, Mapping

from .layout_split import chunk_range, split_rules as _split_rules  # noqa: F401


class ConfigError(ValueError):
    """A bad setting: the message names the field, the value and the rule."""


class Axis(StrEnum):
    """A named process group of the mesh. ``Axis("tpp")`` raises ``ValueError`` listing the
    valid names; members compare equal to their strings (``Axis.TP == "tp"``)."""

    TP = "tp"
    CP = "cp"
    EP = "ep"
    DP = "dp"
    PP = "pp"
    ETP = "etp"
    EDP = "edp"
    DP_CP = "dp_cp"
    TP_CP = "tp_cp"
    MP = "mp"
    TP_DP_CP = "tp_dp_cp"

    @classmethod
    def _missing_(cls, value):
        raise ValueError(f"axis {value!r} is not a mesh axis (choose from "
                         f"{', '.join(a.value for a in cls)})")


#: the degrees a case sets, in Megatron-Core's order (tp fastest, pp slowest)
DEGREES = (Axis.TP, Axis.CP, Axis.EP, Axis.DP, Axis.PP)
#: the rank order of the dense part and of the expert part of a stage
DENSE_ORDER = (Axis.TP, Axis.CP, Axis.DP, Axis.PP)
EXPERT_ORDER = (Axis.ETP, Axis.EP, Axis.EDP, Axis.PP)

#: every group built for a mesh: name -> (order, axes). Names follow Megatron where it has one.
GROUP_SPECS: dict[Axis, tuple[tuple[Axis, ...], tuple[Axis, ...]]] = {
    Axis.TP: (DENSE_ORDER, (Axis.TP,)),
    Axis.CP: (DENSE_ORDER, (Axis.CP,)),
    Axis.DP: (DENSE_ORDER, (Axis.DP,)),
    Axis.PP: (DENSE_ORDER, (Axis.PP,)),
    Axis.DP_CP: (DENSE_ORDER, (Axis.CP, Axis.DP)),  # gradient reduction with cp
    Axis.TP_CP: (DENSE_ORDER, (Axis.TP, Axis.CP)),
    Axis.MP: (DENSE_ORDER, (Axis.TP, Axis.PP)),  # model parallel
    Axis.TP_DP_CP: (DENSE_ORDER, (Axis.TP, Axis.CP, Axis.DP)),  # one pipeline stage
    Axis.EP: (EXPERT_ORDER, (Axis.EP,)),
    Axis.ETP: (EXPERT_ORDER, (Axis.ETP,)),
    Axis.EDP: (EXPERT_ORDER, (Axis.EDP,)),
}

assert set(Axis) == set(GROUP_SPECS), "Axis and GROUP_SPECS disagree"


def padded_vocab(vocab_size: int, tp: int, divisible_by: int = 1) -> int:
    """V' = the smallest multiple of ``divisible_by * tp`` not below V (Megatron-LM's
    ``_vocab_size_with_padding``; ``--make-vocab-size-divisible-by``, 128 there, 1 for the
    reference model): vocab-parallel layers then split V' evenly over tp."""
    mult = divisible_by * tp
    return -(-vocab_size // mult) * mult


@dataclass(frozen=True)
class Layout:
    """How many ranks each parallelism takes, and how a step is cut into micro-batches.

    ``etp``: expert tensor-parallel size, 0 = tp (Megatron-Core's default). ``vpp``: model
    chunks (virtual stages) per pipeline rank. ``num_microbatches``: per data-parallel rank
    per step. ``schedule``: the pipeline schedule's name (``parbench.schedules``).
    ``first_stage_layers`` / ``last_stage_layers``: the layers of the first / last pipeline
    rank when they differ from the others (Megatron-Core's
    ``num_layers_in_first_pipeline_stage`` / ``..._last_...``; 0 = not set, an even split);
    see :func:`pipeline_chunks`.
    """

    tp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 0
    dp: int = 1
    pp: int = 1
    vpp: int = 1
    micro_batch_size: int = 2
    num_microbatches: int = 1
    schedule: str = "1f1b"
    first_stage_layers: int = 0
    last_stage_layers: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "schedule":
                if not isinstance(v, str) or not v:
                    raise ConfigError(f"schedule={v!r} must be a schedule name")
                continue
            low = 0 if f.name in _ZERO_MEANS_UNSET else 1
            if isinstance(v, bool) or not isinstance(v, int):
                raise ConfigError(f"{f.name}={v!r} must be an integer")
            if v < low:
                raise ConfigError(f"{f.name}={v} must be >= {low}"
                                  + (" (0 = tp)" if f.name == "etp" else ""))
        _check_expert_grid(self)
        _check_uneven_stages(self)

    # ---- derived sizes ------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        """tp x cp x dp x pp (ep re-partitions a stage's ranks; it is not a factor)."""
        return self.tp * self.cp * self.dp * self.pp

    @property
    def expert_tp(self) -> int:
        return self.etp or self.tp

    @property
    def edp(self) -> int:
        """Expert data-parallel size: tp cp dp / (etp ep)."""
        return self.tp * self.cp * self.dp // (self.expert_tp * self.ep)

    @property
    def dp_cp(self) -> int:
        """Ranks that reduce the dense gradients: dp x cp (Megatron-Core's ``dp_cp``)."""
        return self.dp * self.cp

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.num_microbatches * self.dp

    def size(self, axis: Axis | str) -> int:
        """Ranks in one group of ``axis`` (``size("edp")``, ``size("dp_cp")``, ...)."""
        return self._sizes()[Axis(axis)]

    def enabled(self, axis: Axis | str) -> bool:
        """More than one rank on ``axis``."""
        return self.size(axis) > 1

    def degrees(self) -> dict[str, int]:
        """The five degrees a case sets, in Megatron's order: ``{"tp": 2, "cp": 1, ...}``."""
        return {a.value: getattr(self, a.value) for a in DEGREES}

    @property
    def uneven(self) -> bool:
        """The first or the last pipeline rank holds its own number of layers."""
        return bool(self.first_stage_layers or self.last_stage_layers)

    def chunk_layers(self, num_layers: int) -> list[int]:
        """Layers of each virtual stage ``c * pp + r`` (chunk c of pipeline rank r), in the
        model's order: :func:`pipeline_chunks` of this layout."""
        return pipeline_chunks(num_layers, self.pp, self.vpp, self.first_stage_layers,
                               self.last_stage_layers)

    def stage_layers(self, num_layers: int) -> list[int]:
        """Layers held by each pipeline rank (its chunks summed)."""
        chunks = self.chunk_layers(num_layers)
        return [sum(chunks[c * self.pp + r] for c in range(self.vpp)) for r in range(self.pp)]

    def grid(self) -> "Layout":
        """The rank grid alone: the degrees and etp, the rest at their defaults (two cases
        with the same grid share their process groups)."""
        return Layout(tp=self.tp, cp=self.cp, ep=self.ep, etp=self.etp, dp=self.dp,
                      pp=self.pp)

    def label(self) -> str:
        """The degrees above 1, e.g. ``"tp2-pp2"`` (``"single"``: one rank)."""
        return "-".join(f"{a}{n}" for a, n in self.degrees().items() if n > 1) or "single"

    def _sizes(self) -> dict[Axis, int]:
        t, c, d, p = self.tp, self.cp, self.dp, self.pp
        return {Axis.TP: t, Axis.CP: c, Axis.EP: self.ep, Axis.DP: d, Axis.PP: p,
                Axis.ETP: self.expert_tp, Axis.EDP: self.edp, Axis.DP_CP: d * c,
                Axis.TP_CP: t * c, Axis.MP: t * p, Axis.TP_DP_CP: t * c * d}

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_case(cls, case: Any) -> "Layout":
        """The layout of a case: a ``CaseConfig``, or a case dict as rows store it (the
        ``layout`` section, or the ``parallel`` section of files written before it)."""
        if isinstance(case, Layout):
            return case
        if not isinstance(case, Mapping):
            return case.layout
        section = case.get("layout") or case.get("parallel") or {}
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in section.items() if k in names})

    def with_global_batch(self, global_batch_size: int) -> "Layout":
        """This layout with the micro-batches that make ``global_batch_size`` sequences:
        m = B / (b dp)."""
        per = self.micro_batch_size * self.dp
        if global_batch_size < 1 or global_batch_size % per:
            raise ConfigError(f"global_batch_size={global_batch_size} is not a positive "
                              f"multiple of micro_batch_size*dp={per}")
        return replace(self, num_microbatches=global_batch_size // per)

    # ---- the rank grid ------------------------------------------------------------------
    def sizes(self, order: tuple[Axis, ...]) -> dict[Axis, int]:
        s = self._sizes()
        return {a: s[a] for a in order}

    def coords(self, rank: int, order: tuple[Axis, ...] = DENSE_ORDER) -> dict[Axis, int]:
        out, r = {}, rank
        for axis, size in self.sizes(order).items():
            out[axis] = r % size
            r //= size
        return out

    def rank_of(self, order: tuple[Axis, ...] = DENSE_ORDER, **coords: int) -> int:
        rank, stride = 0, 1
        for axis, size in self.sizes(order).items():
            rank += coords.get(axis.value, 0) * stride
            stride *= size
        return rank

    def groups(self, name: Axis | str) -> list[list[int]]:
        """Every group of the named kind, e.g. ``groups("tp")``, listed by smallest rank as
        Megatron lists them."""
        order, axes = GROUP_SPECS[Axis(name)]
        sizes = self.sizes(order)
        others = [a for a in order if a not in axes]
        out = []
        for fixed in product(*(range(sizes[a]) for a in reversed(others))):
            coords = {a.value: i for a, i in zip(reversed(others), fixed)}
            members = []
            for inner in product(*(range(sizes[a]) for a in reversed(axes))):
                coords.update({a.value: i for a, i in zip(reversed(axes), inner)})
                members.append(self.rank_of(order, **coords))
            out.append(members)
        return sorted(out, key=lambda g: g[0])

    def group_of(self, name: Axis | str, rank: int) -> list[int]:
        for g in self.groups(name):
            if rank in g:
                return g
        raise KeyError(f"rank {rank} is in no {Axis(name)} group")

    def describe(self) -> dict:
        """The grid as ``parbench mesh`` prints it: degrees, coordinates, every group."""
        return {"world_size": self.world_size, "degrees": self.degrees(),
                "ranks": {r: {a.value: i for a, i in self.coords(r).items()}
                          for r in range(self.world_size)},
                "groups": {a.value: self.groups(a) for a in GROUP_SPECS}}

    # ---- the rules that involve the model -----------------------------------------------
    def check_model(self, model: Any, *, sp: bool = False, cp_balance: str = "none") -> None:
        """Every rule between these degrees and a model (``ModelConfig``, ``Shape`` or any
        object with their field names); see :func:`model_rules`."""
        for rule in model_rules(self, model, sp=sp, cp_balance=cp_balance):
            raise ConfigError(rule)

    def fits_model(self, model: Any, *, sp: bool = False, cp_balance: str = "none") -> bool:
        """No rule of :meth:`check_model` is broken (the planner's filter)."""
        return not any(True for _ in model_rules(self, model, sp=sp, cp_balance=cp_balance))


#: fields whose 0 means "not set" (the others are at least 1)
_ZERO_MEANS_UNSET = ("etp", "first_stage_layers", "last_stage_layers")


def _check_uneven_stages(lay: Layout) -> None:
    """An uneven first / last stage needs a pipeline, and (interleaved) as many chunks of it
    as vpp: Megatron-Core's ``TransformerConfig`` rules."""
    for name in ("first_stage_layers", "last_stage_layers"):
        n = getattr(lay, name)
        if n and lay.pp == 1:
            raise ConfigError(f"{name}={n} needs pp > 1 (pp=1 has one stage)")
        if n % lay.vpp:
            raise ConfigError(f"{name}={n} is not a multiple of vpp={lay.vpp} (each of the "
                              "rank's model chunks holds the same number of layers)")


def pipeline_chunks(num_layers: int, pp: int, vpp: int = 1, first: int = 0,
                    last: int = 0) -> list[int]:
    """The layers of each virtual stage ``c * pp + r``, in the model's order; raises
    :class:`ConfigError` naming the rule that the split breaks.

    Even split (``first = last = 0``): every chunk holds L / (pp vpp) layers (Narayanan et al.
    2021, Sec. 2.2). Uneven (Megatron-Core's ``num_layers_in_first_pipeline_stage`` and
    ``..._last_...``, ``get_transformer_layer_offset``): the first / last rank holds ``first``
    / ``last`` layers, the ``pp'`` ranks between (pp minus the ends that are set) share the
    rest evenly, each rank's layers cut into ``vpp`` equal chunks. Llama 3 405B: 126 layers on
    16 stages as 7 + 14 x 8 + 7 (Llama Team 2024, Sec. 3.3.2)."""
    for msg in _split_rules(num_layers, pp, vpp, first, last):
        raise ConfigError(msg)
    middle_ranks = pp - bool(first) - bool(last)
    mid = (num_layers - first - last) // middle_ranks if middle_ranks else 0
    per_rank = [mid] * pp
    if first:
        per_rank[0] = first
    if last:
        per_rank[-1] = last
    return [per_rank[r] // vpp for _ in range(vpp) for r in range(pp)]


def _check_expert_grid(lay: Layout) -> None:
    """ep re-partitions the tp cp dp ranks of a stage as expert-tp x ep x expert-dp, so
    etp ep must divide tp cp dp (with etp = tp: ep divides cp dp)."""
    stage = lay.tp * lay.cp * lay.dp
    if lay.expert_tp == lay.tp and (lay.cp * lay.dp) % lay.ep:
        raise ConfigError(f"ep={lay.ep} does not divide cp*dp={lay.cp * lay.dp} "
                          "(expert parallelism re-partitions the tp*cp*dp ranks of a stage)")
    if stage % (lay.expert_tp * lay.ep):
        raise ConfigError(f"etp*ep={lay.expert_tp}*{lay.ep} does not divide tp*cp*dp={stage} "
                          "(expert parallelism re-partitions the tp*cp*dp ranks of a stage)")


def _dims(model: Any) -> dict[str, int]:
    get = lambda name, default=0: getattr(model, name, default) or default  # noqa: E731
    h = get("hidden_size")
    return {"heads": get("num_heads"), "kv_heads": get("num_kv_heads") or get("num_heads"),
            "head": h // get("num_heads", 1),
            "ffn": get("ffn_hidden_size") or 4 * h, "seq": get("seq_length"),
            "vocab": get("vocab_size"), "div": get("make_vocab_size_divisible_by", 1),
            "experts": get("num_experts"), "layers": get("num_layers"),
            "mla": get("kv_lora_rank")}


def model_rules(lay: Layout, model: Any, *, sp: bool = False, cp_balance: str = "none"):
    """The broken rules between ``lay`` and ``model``, each as one message (field, value,
    rule); an empty iteration when every rule holds.

    - tp divides the attention heads and the MLP's hidden size (Shoeybi et al. 2019, Sec. 3:
      heads and the MLP's columns are split over tp);
    - K/V heads under grouped-query attention: tp divides them, or they divide tp, each
      shared by tp / num_kv_heads ranks, and tp divides the fused QKV's output width
      (Megatron-Core's rule and its even split of linear_qkv: ``analytic.gqa``);
    - tp divides the padded vocabulary (it always does: the padding is a multiple of tp);
    - cp divides the sequence, 2 cp with the zig-zag split (Liu et al. 2023; each rank takes
      two chunks); with sequence parallelism tp divides the rank's s / cp tokens (Korthikanti
      et al. 2022, Sec. 4.2.2);
    - ep divides the experts, and needs an MoE model;
    - pp x vpp divides the layers (Narayanan et al. 2021, Sec. 2.2), or the layers besides an
      uneven first / last stage split evenly over the middle ranks (:func:`pipeline_chunks`).
    """
    d = _dims(model)
    t = lay.tp
    if d["heads"] % t:
        yield f"tp={t} does not divide num_heads={d['heads']}"
    if d["kv_heads"] % t and t % d["kv_heads"]:
        yield (f"tp={t} and num_kv_heads={d['kv_heads']}: one must divide the other (K/V "
               "heads are split over tp, or each shared by tp/num_kv_heads ranks)")
    elif d["kv_heads"] < t and d["heads"] and (d["heads"] + 2 * d["kv_heads"]) * d["head"] % t:
        yield (f"tp={t} does not divide the fused QKV width (num_heads + 2 num_kv_heads) "
               f"head_dim={(d['heads'] + 2 * d['kv_heads']) * d['head']}")
    if d["ffn"] % t:
        yield f"tp={t} does not divide ffn_hidden_size={d['ffn']}"
    if padded_vocab(d["vocab"], t, d["div"]) % t:
        yield f"tp={t} does not divide the padded vocabulary"
    chunks = 2 * lay.cp if cp_balance == "zigzag" and lay.cp > 1 else lay.cp
    if d["seq"] % chunks:
        what = "2*cp" if chunks != lay.cp else "cp"
        yield f"{what}={chunks} does not divide seq_length={d['seq']}"
    elif lay.cp > 1 and d["mla"]:
        yield (f"cp={lay.cp} with kv_lora_rank={d['mla']}: multi-head latent attention is "
               "not modelled under context parallelism (set cp=1)")
    elif sp and t > 1 and (d["seq"] // lay.cp) % t:
        yield (f"sp with tp={t} needs tp to divide seq_length/cp="
               f"{d['seq']}/{lay.cp}={d['seq'] // lay.cp}")
    if lay.ep > 1 and not d["experts"]:
        yield f"ep={lay.ep} needs an MoE model (num_experts=0)"
    elif lay.ep > 1 and d["experts"] % lay.ep:
        yield f"ep={lay.ep} does not divide num_experts={d['experts']}"
    if d["layers"]:
        yield from _split_rules(d["layers"], lay.pp, lay.vpp, lay.first_stage_layers,
                                lay.last_stage_layers)
