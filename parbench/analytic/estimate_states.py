"""The model-state block of ``estimate``: bytes per rank under each ZeRO stage and accounting,
per gradient group (dense over dp x cp, experts over edp), with the largest-layer buffer of
DeepSpeed's estimate; and the largest model whose states fit a device (ZeRO paper Table 2)."""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..layout import Layout
from . import memory
from .estimate_blocks import Block, StageParams, optional
from .shape import GB


@dataclass(frozen=True)
class StateBytes(Block):
    """Bytes of parameters, gradients and optimizer states on one rank, and DeepSpeed's
    ZeRO-3 largest-layer ``buffer`` where it applies; ``total`` includes it."""

    param: float
    grad: float
    optim: float
    buffer: float | None = None

    @property
    def total(self) -> float:
        return self.param + self.grad + self.optim + (self.buffer or 0)

    @classmethod
    def of(cls, states: memory.ModelStates) -> "StateBytes":
        return cls(states.param, states.grad, states.optim)

    def plus(self, other: "StateBytes") -> "StateBytes":
        """Two groups' states on one rank, summed (neither with a buffer)."""
        return StateBytes(self.param + other.param, self.grad + other.grad,
                          self.optim + other.optim)

    def as_dict(self) -> dict[str, float]:
        out = {"param": self.param, "grad": self.grad, "optim": self.optim,
               "total": self.total}
        if self.buffer is not None:
            out["buffer"] = self.buffer
        return out


@dataclass(frozen=True)
class LayerBuffer(Block):
    """DeepSpeed's ZeRO-3 buffer: the largest module gathered whole."""

    largest_layer_params: int
    bytes: float
    source: str = ("DeepSpeed estimate_zero3_model_states_mem_needs: "
                   "4 * largest_layer_params + 18 * params / gpus")


@dataclass(frozen=True)
class SelectedStates(Block):
    """The states of the selected ZeRO stage and accounting: exact flat-buffer figures
    (``padded``: every rank allocates ceil(n/d); ``unpadded``: rank 0's real elements) for an
    integer count, else the paper's ``paper`` figure."""

    zero_stage: int
    accounting: str
    padded: StateBytes | None = optional()
    unpadded: StateBytes | None = optional()
    paper: StateBytes | None = optional()
    layer_buffer: LayerBuffer | None = optional()

    @property
    def total(self) -> float:
        """The bytes a rank holds: the padded exact figure, or the paper's."""
        return (self.padded or self.paper).total


@dataclass(frozen=True)
class GroupStates(Block):
    """One gradient group of an MoE model: its ranks and its share of the states."""

    group: str
    group_size: int
    per_rank_params: int
    padded: StateBytes
    unpadded: StateBytes


@dataclass(frozen=True)
class ModelStatesBlock(Block):
    """Model states of the most loaded pipeline rank: ``by_accounting`` (every accounting,
    every ZeRO stage, bytes), ``zero_paper_gb`` (mixed-precision Adam in the paper's GB) and
    the ``selected`` stage and accounting; for an MoE model the dense and expert ``groups``."""

    per_rank_params: float
    by_accounting: dict[str, dict[str, float]]
    zero_paper_gb: dict[str, float]
    selected: SelectedStates
    pipeline_stage: int | None = optional()
    units: str = ("bytes; zero_paper_gb in GB = 1e9 bytes, 3 significant figures "
                  "(mixed_adam, K = 12)")
    groups: dict[str, GroupStates] | None = optional()
    scope: str | None = optional()

    def as_dict(self) -> dict:
        d = super().as_dict()  # the order the figures were always printed in
        order = ("per_rank_params", "pipeline_stage", "by_accounting", "zero_paper_gb",
                 "units", "selected", "groups", "scope")
        return {k: d[k] for k in order if k in d}


def _paper_gb(table: dict[str, float]) -> dict[str, float]:
    return {k: memory.round_sig(v / GB, 3) for k, v in table.items()}


def model_states(psi: float, dp: int, zero_stage: int, chosen: str) -> ModelStatesBlock:
    """The states of ``psi`` parameters replicated over ``dp`` ranks (Rajbhandari et al.
    2020, Sec. 5.1): exact per flat buffer when ``psi`` is an integer."""
    by_acc = {name: memory.zero_table(psi, dp, acc) for name, acc in memory.ACCOUNTINGS.items()}
    if float(psi).is_integer():
        exact = memory.zero_model_states_exact(int(psi), dp, zero_stage, chosen)
        selected = SelectedStates(zero_stage, chosen, padded=StateBytes.of(exact["padded"]),
                                  unpadded=StateBytes.of(exact["unpadded"]))
    else:
        paper = memory.zero_model_states(psi, dp, zero_stage, chosen)
        selected = SelectedStates(zero_stage, chosen, paper=StateBytes.of(paper))
    return ModelStatesBlock(per_rank_params=psi, by_accounting=by_acc,
                       zero_paper_gb=_paper_gb(by_acc[memory.MIXED_ADAM.name]),
                       selected=selected)


def with_layer_buffer(block: ModelStatesBlock,
                      largest_layer: int | None) -> ModelStatesBlock:
    """DeepSpeed's ZeRO-3 largest-layer buffer (``layer_buffer`` bytes per parameter of the
    largest module, :func:`.params.largest_module_params`) added to the selected states as
    ``buffer`` (and to their ``total``); the block unchanged for other accountings or stages."""
    sel = block.selected
    acc = memory.get_accounting(sel.accounting)
    if not acc.layer_buffer or sel.zero_stage != 3 or largest_layer is None:
        return block
    buf = acc.layer_buffer * largest_layer
    add = {k: replace(getattr(sel, k), buffer=buf) for k in ("padded", "unpadded", "paper")
           if getattr(sel, k) is not None}
    return replace(block, selected=replace(sel, **add,
                                           layer_buffer=LayerBuffer(largest_layer, buf)))


_GROUP_NAMES = {"dense": "dp x cp (dense parameters: replicated over the dp*cp ranks)",
                "expert": "edp = tp*cp*dp/(etp*ep) (expert parameters: E/ep experts per rank, "
                          "each split over etp)"}


def _add(a: dict, b: dict) -> dict:
    return {k: _add(v, b[k]) if isinstance(v, dict) else v + b[k] for k, v in a.items()}


def _stage_groups(st: StageParams, lay: Layout, zero_stage: int,
                  chosen: str) -> dict[str, ModelStatesBlock]:
    return {"dense": model_states(st.dense, lay.dp_cp, zero_stage, chosen),
            "expert": model_states(st.expert, lay.edp, zero_stage, chosen)}


def moe_model_states(stages: list[StageParams], lay: Layout, zero_stage: int,
                     chosen: str) -> ModelStatesBlock:
    """Model states of the most loaded pipeline rank of an MoE model: the dense part over
    dp x cp and the expert part over edp, each partitioned by ZeRO over its own group
    (Rajbhandari et al. 2020, Sec. 5.1, applied per group, as Megatron-Core's distributed
    optimizer does), and their sum."""
    loads = [(sum(p.selected.padded.total for p in parts.values()), st.stage, parts)
             for st in stages
             for parts in (_stage_groups(st, lay, zero_stage, chosen),)]
    _, stage, parts = max(loads, key=lambda x: x[0])  # the first of equal loads
    d, x = parts["dense"], parts["expert"]
    by_acc = _add(d.by_accounting, x.by_accounting)
    sizes = {"dense": lay.dp_cp, "expert": lay.edp}
    groups = {kind: GroupStates(_GROUP_NAMES[kind], sizes[kind], p.per_rank_params,
                                p.selected.padded, p.selected.unpadded)
              for kind, p in parts.items()}
    selected = SelectedStates(zero_stage, chosen,
                              padded=d.selected.padded.plus(x.selected.padded),
                              unpadded=d.selected.unpadded.plus(x.selected.unpadded))
    return ModelStatesBlock(
        per_rank_params=d.per_rank_params + x.per_rank_params, pipeline_stage=stage,
        by_accounting=by_acc, zero_paper_gb=_paper_gb(by_acc[memory.MIXED_ADAM.name]),
        selected=selected, groups=groups,
        scope="the most loaded pipeline rank; each part's ZeRO partition is over its own "
              "group (dense: dp x cp, expert: edp)")


@dataclass(frozen=True)
class ModelFits(Block):
    """The largest parameter count whose mixed-precision Adam states (K = 12) fit a device
    of ``device_bytes`` at each ZeRO stage, activations ignored (ZeRO paper Table 2)."""

    device_bytes: float
    by_stage: dict[str, float]
    note: str = ("parameters whose mixed-precision Adam model states (K = 12) fit, "
                 "activations ignored (ZeRO paper Table 2)")

    def as_dict(self) -> dict:
        return {"device_bytes": self.device_bytes, **self.by_stage, "note": self.note}


def model_fits(device_bytes: float, lay: Layout) -> ModelFits:
    """:func:`.memory.largest_model_fits` at every stage, with dp data-parallel ranks and
    tp x pp model parallelism dividing the model."""
    mp = lay.tp * lay.pp
    return ModelFits(device_bytes, {
        name: memory.largest_model_fits(device_bytes, lay.dp, stage, memory.MIXED_ADAM, mp)
        for stage, name in memory.STAGE_NAMES.items()})
