"""Reading rows written before the row was grouped (parbench 0.1's flat rows).

A flat row is one JSON object of about fifty fields (``id``, ``equivalent``,
``wire_bytes_per_rank``, ``model_state_bytes``, ...) with the scheme's figures in ``extra``
(the pipeline's bubble ratios as ``bubble_*`` keys beside ``bubble_detail``), the closed
forms' further figures in ``prediction`` and the first failure as a dict. ``grouped`` maps
each onto its group of ``Row``, as the JSON object of this format, which
``Row.from_dict`` then reads as any other. Figures a flat row derived (``wire_bytes``,
``other_peak_bytes``) are derived again by the groups; fields files of the time did not write
take their defaults. Pure functions on dicts: no other module.
"""
from __future__ import annotations

#: flat key -> (group, field), for the fields that only moved
MOVED = {
    "suite": ("case", "suite"), "scheme": ("case", "scheme"), "family": ("case", "family"),
    "baseline_of": ("case", "baseline_of"), "model": ("case", "model"),
    "status": ("verdict", "status"), "failure": ("verdict", "failure"),
    "equivalent": ("verdict", "equivalent"), "golden_ok": ("verdict", "golden_ok"),
    "update_ok": ("verdict", "update_ok"), "max_loss_abs": ("verdict", "max_loss_abs"),
    "max_grad_abs": ("verdict", "max_grad_abs"), "max_param_abs": ("verdict", "max_param_abs"),
    "max_update_excess": ("verdict", "max_update_excess"),
    "tolerance": ("verdict", "tolerance"), "first_failure": ("verdict", "first_failure"),
    "uncovered": ("verdict", "uncovered"),
    "detectable_wd_error": ("verdict", "detectable_wd_error"),
    "losses": ("verdict", "losses"), "golden_losses": ("verdict", "golden_losses"),
    "golden_source": ("verdict", "golden_source"),
    "step_time_s": ("time", "step_s"), "step_times_s": ("time", "per_rank_s"),
    "tokens_per_s": ("time", "tokens_per_s"),
    "peak_bytes": ("memory", "peak_bytes"), "peak_bytes_predicted": ("memory", "peak_predicted"),
    "wire_bytes_per_rank": ("traffic", "wire"), "calls_per_rank": ("traffic", "calls"),
    "wire_bytes_predicted_per_rank": ("traffic", "wire_predicted"),
    "calls_predicted_per_rank": ("traffic", "calls_predicted"),
    "wire_exact": ("traffic", "wire_exact"), "calls_exact": ("traffic", "calls_exact"),
    "host_cpus": ("env", "host_cpus"), "torch": ("env", "torch"), "python": ("env", "python"),
    "trace": ("env", "trace"), "figures": ("env", "figures"),
}
#: the flat ``extra`` keys that were the pipeline's bubble figures -> BubbleFigures fields
BUBBLE_KEYS = {"bubble_measured": "measured", "bubble_replayed": "replayed",
               "bubble_sim_mean_costs": "sim_mean_costs", "bubble_unit": "unit",
               "bubble_closed_form": "closed_form", "bubble_detail": "detail",
               "schedule": "schedule", "held_graphs": "held_graphs",
               "activation_peak_bytes": "activation_peak_bytes"}
DEGREES = ("tp", "cp", "ep", "dp", "pp", "vpp")


def is_flat(d: dict) -> bool:
    """A row of the earlier format: no ``case`` group (its ``case`` was the configuration)."""
    return not (isinstance(d.get("case"), dict) and "config" in d["case"])


def grouped(d: dict) -> dict:
    """The JSON object of the grouped row that the flat row ``d`` describes."""
    if "id" not in d:
        raise TypeError("not a results row (no id)")
    out: dict = {"case": {"id": d["id"], "config": d.get("case") or {},
                          "layout": _layout(d)},
                 "verdict": {}, "time": {}, "memory": {"states": _states(d)},
                 "traffic": {"ops": _ops(d.get("ledger_summary"))}, "env": {}}
    for key, (group, name) in MOVED.items():
        if key in d:
            out[group][name] = d[key]
    if isinstance(out["verdict"].get("first_failure"), dict):
        out["verdict"]["first_failure"] = _first_failure(out["verdict"]["first_failure"])
    _traffic_fallbacks(d, out["traffic"])
    extra = dict(d.get("extra") or {})
    if "bubble_replayed" in extra or "bubble_detail" in extra:
        out["pipeline"] = {f: extra.pop(k) for k, f in BUBBLE_KEYS.items() if k in extra}
    out["scheme_figures"] = extra
    out["analytic"] = dict(d.get("prediction") or {})
    return out


def _layout(d: dict) -> dict:
    """The case's layout section (``parallel`` before the layout record existed); else the
    stored degrees."""
    config = d.get("case") or {}
    section = config.get("layout") or config.get("parallel")
    if isinstance(section, dict) and section:
        return dict(section)
    return {k: v for k, v in (d.get("degrees") or {}).items() if k in DEGREES}


def _first_failure(f: dict) -> dict:
    """Empty tensor and detail were absent keys."""
    return {**f, "tensor": f.get("tensor") or "", "detail": f.get("detail") or "",
            "what": f.get("what", "?")}


def _paper_states(prediction) -> float | None:
    """The ZeRO paper's mixed-precision accounting, as impls/zero/prediction.py wrote it."""
    paper = (prediction or {}).get("paper") or {}
    mixed = (paper.get("model_state_bytes") or {}).get("mixed_adam") or {}
    return mixed.get("total")


def _states(d: dict) -> dict:
    return {"measured": d.get("model_state_bytes") or [],
            "predicted": d.get("model_state_bytes_predicted"),
            "exact": d.get("model_state_exact"),
            "paper": _paper_states(d.get("prediction"))}


def _ops(summary) -> list[dict]:
    """``{"axis/op": {count, message_bytes, wire_bytes}}`` -> OpTally objects."""
    out = []
    for key, e in (summary or {}).items():
        axis, _, op = key.partition("/")
        out.append({"axis": axis, "op": op, **e})
    return out


def _traffic_fallbacks(d: dict, traffic: dict) -> None:
    """Files that kept only the largest rank's bytes: that rank stands for them all."""
    if not traffic.get("wire") and d.get("wire_bytes"):
        traffic["wire"] = [dict(d["wire_bytes"])]
    if traffic.get("wire_predicted") is None and d.get("wire_bytes_predicted"):
        traffic["wire_predicted"] = [dict(d["wire_bytes_predicted"])]
