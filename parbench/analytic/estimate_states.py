"""The model-state blocks of ``estimate``: bytes per rank under each ZeRO stage and accounting,
per gradient group (dense over dp x cp, experts over edp), with the largest-layer buffer of
DeepSpeed's estimate."""
from __future__ import annotations

from typing import Any

from . import memory
from .shape import (GB)


def _add_layer_buffer(block: dict, zero_stage: int, chosen: str,
                      largest_layer: int | None) -> None:
    """DeepSpeed's ZeRO-3 largest-layer buffer (``layer_buffer`` bytes per parameter of the
    largest module, :func:`.params.largest_module_params`) added to the selected states as
    ``buffer`` (and to their ``total``); nothing for other accountings or stages."""
    acc = memory.get_accounting(chosen)
    if not acc.layer_buffer or zero_stage != 3 or largest_layer is None:
        return
    buf = acc.layer_buffer * largest_layer
    sel = block["selected"]
    sel["layer_buffer"] = {"largest_layer_params": largest_layer, "bytes": buf,
                           "source": "DeepSpeed estimate_zero3_model_states_mem_needs: "
                                     "4 * largest_layer_params + 18 * params / gpus"}
    for key in ("padded", "unpadded", "paper"):
        if key in sel:
            sel[key] = {**sel[key], "buffer": buf, "total": sel[key]["total"] + buf}


def _model_states_block(psi: float, dp: int, zero_stage: int, chosen: str) -> dict:
    block: dict[str, Any] = {
        "per_rank_params": psi,
        "by_accounting": {name: memory.zero_table(psi, dp, acc)
                          for name, acc in memory.ACCOUNTINGS.items()},
        "zero_paper_gb": {k: memory.round_sig(v / GB, 3)
                          for k, v in memory.zero_table(psi, dp, memory.MIXED_ADAM).items()},
        "units": "bytes; zero_paper_gb in GB = 1e9 bytes, 3 significant figures "
                 "(mixed_adam, K = 12)",
        "selected": {"zero_stage": zero_stage, "accounting": chosen},
    }
    if float(psi).is_integer():
        exact = memory.zero_model_states_exact(int(psi), dp, zero_stage, chosen)
        block["selected"].update({k: v.as_dict() for k, v in exact.items()})
    else:
        block["selected"]["paper"] = memory.zero_model_states(psi, dp, zero_stage,
                                                              chosen).as_dict()
    return block


_GROUP_NAMES = {"dense": "dp x cp (dense parameters: replicated over the dp*cp ranks)",
                "expert": "edp = tp*cp*dp/(etp*ep) (expert parameters: E/ep experts per rank, "
                          "each split over etp)"}


def _add(a: dict, b: dict) -> dict:
    return {k: _add(v, b[k]) if isinstance(v, dict) else v + b[k] for k, v in a.items()}


def _moe_model_states_block(stages: list[dict], layout: dict, zero_stage: int,
                            chosen: str) -> dict:
    """Model states of the most loaded pipeline rank of an MoE model: the dense part over
    dp x cp and the expert part over edp, each partitioned by ZeRO over its own group
    (Rajbhandari et al. 2020, Sec. 5.1, applied per group), and their sum."""
    best = None
    for st in stages:
        parts = {"dense": _model_states_block(st["dense"], layout["dense_dp"], zero_stage,
                                              chosen),
                 "expert": _model_states_block(st["expert"], layout["edp"], zero_stage,
                                               chosen)}
        load = sum(p["selected"]["padded"]["total"] for p in parts.values())
        if best is None or load > best[0]:
            best = (load, st["stage"], parts)
    _, stage, parts = best
    d, x = parts["dense"], parts["expert"]
    by_acc = _add(d["by_accounting"], x["by_accounting"])
    groups = {}
    for kind, size in (("dense", layout["dense_dp"]), ("expert", layout["edp"])):
        p = parts[kind]
        groups[kind] = {"group": _GROUP_NAMES[kind], "group_size": size,
                        "per_rank_params": p["per_rank_params"],
                        "padded": p["selected"]["padded"],
                        "unpadded": p["selected"]["unpadded"]}
    return {
        "per_rank_params": d["per_rank_params"] + x["per_rank_params"],
        "pipeline_stage": stage,
        "by_accounting": by_acc,
        "zero_paper_gb": {k: memory.round_sig(v / GB, 3)
                          for k, v in by_acc[memory.MIXED_ADAM.name].items()},
        "units": d["units"],
        "selected": {"zero_stage": zero_stage, "accounting": chosen,
                     "padded": _add(d["selected"]["padded"], x["selected"]["padded"]),
                     "unpadded": _add(d["selected"]["unpadded"], x["selected"]["unpadded"])},
        "groups": groups,
        "scope": "the most loaded pipeline rank; each part's ZeRO partition is over its own "
                 "group (dense: dp x cp, expert: edp)",
    }
