"""The golden run: the unpartitioned model trained on one device.

``train`` trains the whole reference model on the global batch of every step (one forward
over the whole batch, mean token cross-entropy) with the same seed, data and optimizer as the
schemes, keeping the loss, the gradients and the updated parameters of each step. An MoE
model routes the groups its scheme routes (``parbench.model.moe``), which the caller passes
in (``Scheme.routing_groups``).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

import torch

from ..config import ANALYTIC_ONLY_FIELDS, CaseConfig
from ..model import GPTStage, build_model, make_optimizer, synthetic_batch
from ..model.moe import RoutingGroups


@dataclass
class GoldenRun:
    losses: list[float] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    params: list[dict[str, torch.Tensor]] = field(default_factory=list)
    #: "live" (trained in this process) or "stored:<file>" (a committed golden file)
    source: str = "live"


def global_batch(case: CaseConfig, step: int):
    return synthetic_batch(case.model, case.layout.global_batch_size, case.run.seed, step)


def moe_routing(case: CaseConfig, routing: RoutingGroups | None) -> RoutingGroups | None:
    """The routing groups the golden run routes: ``routing`` for an MoE model, none for a
    dense one. An MoE case without them is an error: the golden run cannot know how the
    ranks cut the batch."""
    if not case.model.num_experts:
        return None
    if routing is None:
        raise ValueError(f"num_experts={case.model.num_experts}: the golden run of an MoE "
                         "model needs the routing groups of its scheme "
                         "(Scheme.routing_groups)")
    return routing


def reference_model(case: CaseConfig, routing: RoutingGroups | None = None) -> GPTStage:
    """The whole reference model at its seeded initialisation, routing ``routing``."""
    return build_model(case.model, case.run.seed, moe_routing(case, routing))


def golden_key(case: CaseConfig, steps: int, routing: RoutingGroups | None = None) -> str:
    """What a single-device reference run depends on: the model, the global batch, the seed,
    the optimizer and the number of steps (and, for an MoE model, the routing groups)."""
    d = case.to_dict()
    keep_run = {k: d["run"][k] for k in ("seed", "optimizer", "lr", "weight_decay", "beta1",
                                         "beta2", "eps")}
    # the estimate-only fields (a runnable case has them at their defaults) do not change the
    # reference model, so they stay out of the key
    model = {k: v for k, v in d["model"].items()
             if not (k in ANALYTIC_ONLY_FIELDS and v == ANALYTIC_ONLY_FIELDS[k])}
    parts = [model, case.layout.global_batch_size, keep_run, steps]
    routing = moe_routing(case, routing)
    if routing is not None:
        parts.append(routing.key())
    return json.dumps(parts, sort_keys=True)


def key_routing(key: str) -> RoutingGroups | None:
    """The routing groups a golden key was made with (None: a dense model)."""
    parts = json.loads(key)
    return RoutingGroups.from_key(parts[4]) if len(parts) > 4 else None


def golden_name(key: str) -> str:
    return "g-" + hashlib.sha1(key.encode()).hexdigest()[:12]


def train(case: CaseConfig, steps: int, routing: RoutingGroups | None = None) -> GoldenRun:
    """Train the reference model here for ``steps`` steps ("live")."""
    torch.manual_seed(case.run.seed)
    model = reference_model(case, routing)
    opt = make_optimizer(model.parameters(), case.run)
    out = GoldenRun()
    for step in range(steps):
        x, y = global_batch(case, step)
        opt.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        out.losses.append(float(loss.detach()))
        out.grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        opt.step()
        out.params.append({n: t.detach().clone() for n, t in model.named_parameters()})
    return out
