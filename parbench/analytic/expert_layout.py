"""The expert-parallel layout of a stage's ranks (Megatron-Core's ``parallel_state``):
which data-parallel group each kind of parameter has, and the rules ``ep`` and ``etp`` must
follow. Split from ``parbench.analytic.params`` (one job: the layout; the counts stay there).

Megatron-Core re-partitions the tp x cp x dp ranks of a pipeline stage as etp x ep x edp
(``initialize_model_parallel`` with ``expert_model_parallel_size`` and
``expert_tensor_parallel_size``); the experts are split over ep as in GShard (Lepikhin et al.
2020, Sec. 2.2).
"""
from __future__ import annotations

from .shape import Shape, divides, require_nonneg_int, require_positive_int


def check_ep(shape: Shape, ep: int) -> None:
    require_positive_int("ep", ep)
    if ep > 1 and not shape.moe:
        raise ValueError(f"ep={ep} needs num_experts > 0 (num_experts={shape.num_experts})")
    if shape.moe:
        divides("ep", ep, "num_experts", shape.num_experts)


def resolve_etp(tp: int, etp: int | None) -> int:
    """The expert tensor-parallel size: ``etp``, or ``tp`` when it is 0 or ``None``
    (Megatron-Core's ``expert_tensor_parallel_size`` default)."""
    if etp is None:
        return tp
    require_nonneg_int("etp", etp)
    return etp or tp


def check_etp(shape: Shape, tp: int, etp: int | None) -> int:
    e = resolve_etp(tp, etp)
    if not shape.moe and e != tp:
        raise ValueError(f"etp={e} needs num_experts > 0 (num_experts={shape.num_experts}); "
                         f"a dense model has no expert to split (leave etp=0, i.e. tp={tp})")
    if shape.moe:
        divides("etp", e, "ffn_hidden_size", shape.f)
    return e


def expert_layout(shape: Shape, *, tp: int = 1, cp: int = 1, dp: int = 1, ep: int = 1,
                  etp: int | None = None) -> dict[str, int]:
    """The data-parallel group of each kind of parameter, Megatron-Core layout.

    Dense parameters are replicated over the ``dp * cp`` ranks (gradients reduced over them,
    as Megatron-Core does with context parallelism). Expert parameters: the ``tp * cp * dp``
    ranks of a pipeline stage are re-partitioned as ``etp x ep x edp`` (Megatron-Core
    ``initialize_model_parallel`` with ``expert_model_parallel_size`` and
    ``expert_tensor_parallel_size``), so ``ep * etp`` must divide ``tp * cp * dp`` and each
    expert shard is replicated over ``edp = tp * cp * dp / (etp * ep)`` ranks. Raises
    ``ValueError`` naming the field, its value and the rule it breaks.
    """
    for name, v in (("tp", tp), ("cp", cp), ("dp", dp)):
        require_positive_int(name, v)
    check_ep(shape, ep)
    e = check_etp(shape, tp, etp)
    stage = tp * cp * dp
    if stage % (ep * e):
        raise ValueError(f"ep*etp={ep * e} (ep={ep}, etp={e}) does not divide "
                         f"tp*cp*dp={stage}: expert parallelism re-partitions the tp*cp*dp "
                         "ranks of a stage as etp x ep x edp")
    return {"tp": tp, "etp": e, "ep": ep, "dense_dp": dp * cp, "edp": stage // (ep * e)}
