"""What a golden run depends on, as one canonical key, and the case rebuilt from a key.

The single-device golden run (``run.train``) reads the model, the global batch (the data is
``synthetic_batch(model, global_batch_size, seed, step)``), the run's seed and optimizer, and
for an MoE model the routing groups its scheme routes (``Scheme.routing_groups``). Its key
holds exactly that, so that a stored run is shared by every case with the same reference and
survives harmless changes (issue 20, section 6):

- **in the key**: every model field that differs from ``ModelConfig``'s default (but not its
  ``name``: a preset's label), the global batch size, every run field that differs from
  ``RunConfig``'s default except the ones listed in ``RUN_FIELDS_NOT_READ`` (so seed, lr,
  weight decay, betas, eps, the optimizer, dtype -- and any run field added later), every
  option that differs from its default except ``OPTIONS_NOT_READ`` (none read today; an
  option added later is in), and the routing groups;
- **not in the key**: the degrees and the micro-batch cut (beyond the global batch and the
  routing groups), the scheme, the tolerances, the timed steps, the device, the case id --
  and the number of steps: a stored run of n steps serves any request by prefix
  (``store.reference_run``), so the manifest says how many steps it holds.

Fields at their defaults stay out, so adding a field whose default keeps today's behaviour
changes no key. A changed default changes no key either, but ``golden check`` rebuilds each
case from its key with today's defaults (``case_of_key``) and recomputes it, so the stored
numbers no longer match and CI says to re-record.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import fields

from ..config import CaseConfig, ModelConfig, RunConfig
from ..layout import Layout
from ..model.moe import RoutingGroups
from ..options import FAMILY_OPTIONS, Options

#: the key's format; a stored run of another format is never served
KEY_FORMAT = 2

#: run fields the golden run does not read: what runs on the ranks, how long, how it is
#: checked and timed, and the testing aids
RUN_FIELDS_NOT_READ = frozenset({
    "scheme", "steps", "warmup_steps", "timed_steps", "device", "threads_per_rank",
    "timeout_s", "hang_timeout_s", "rtol", "atol", "param_atol", "instrument",
    "fail_at_step", "fail_rank", "fail_kind", "shared_reference"})

#: options the golden run does not read (how the ranks partition the work); ``family.field``
OPTIONS_NOT_READ = frozenset({
    "tensor.sp", "tensor.tp_depth", "context.cp_algorithm", "context.cp_balance",
    "context.cp_ulysses", "context.cp_window", "pipeline.seq_segments",
    "pipeline.terapipe_slicing", "expert.moe_mode", "expert.moe_a2a", "expert.moe_shadow",
    "data.zero_stage", "data.bucket_mb", "data.local_sgd_period",
    "data.overlap_grad_reduce", "recompute"})


def _changed(obj, default, skip=frozenset()) -> dict:
    """The fields of dataclass ``obj`` that differ from ``default``'s, minus ``skip``."""
    return {f.name: getattr(obj, f.name) for f in fields(obj)
            if f.name not in skip and getattr(obj, f.name) != getattr(default, f.name)}


def _changed_options(options: Options) -> dict:
    base = Options()
    out = {f"{fam}.{k}": v for fam in FAMILY_OPTIONS
           for k, v in _changed(getattr(options, fam), getattr(base, fam)).items()}
    if options.recompute != base.recompute:
        out["recompute"] = options.recompute
    return {k: v for k, v in out.items() if k not in OPTIONS_NOT_READ}


def golden_key(case: CaseConfig, routing: RoutingGroups | None = None) -> str:
    """The canonical key of the golden run of ``case`` routing ``routing`` (module doc);
    ``routing`` is ignored for a dense model."""
    key = {"format": KEY_FORMAT,
           "model": _changed(case.model, ModelConfig(), {"name"}),
           "global_batch": case.layout.global_batch_size,
           "run": _changed(case.run, RunConfig(), RUN_FIELDS_NOT_READ),
           "options": _changed_options(case.options),
           "routing": routing.key() if case.model.num_experts and routing else None}
    return json.dumps(key, sort_keys=True)


def golden_name(key: str) -> str:
    """The file name stem of a key: ``g-`` and 12 hex digits of its SHA-1."""
    return "g-" + hashlib.sha1(key.encode()).hexdigest()[:12]


def case_of_key(key: str) -> tuple[CaseConfig, RoutingGroups | None]:
    """A case (with today's defaults for every field the key leaves out) whose golden run is
    the one ``key`` names, and its routing groups; ``golden_key`` of it gives ``key`` back.
    ValueError for a key of another format."""
    d = json.loads(key)
    if not isinstance(d, dict) or d.get("format") != KEY_FORMAT:
        raise ValueError(f"golden key of another format (this one reads {KEY_FORMAT}): "
                         f"{key[:80]}")
    options: dict = {}
    for dotted, v in d["options"].items():
        fam, _, name = dotted.rpartition(".")
        if fam:
            options.setdefault(fam, {})[name] = v
        else:
            options[name] = v  # recompute, a field of Options itself
    case = CaseConfig(model=ModelConfig(**d["model"]),
                      layout=Layout(micro_batch_size=d["global_batch"]),
                      options=Options.from_dict(options), run=RunConfig(**d["run"]))
    routing = RoutingGroups.from_key(d["routing"]) if d["routing"] is not None else None
    return case, routing
