"""The golden run: the unpartitioned model trained on one device.

``train`` trains the whole reference model on the global batch of every step (one forward
over the whole batch, mean token cross-entropy, gradients clipped by global norm when the run
clips) with the same seed, data and optimizer as the
schemes, keeping the loss, the gradients and the updated parameters of each step. An MoE
model routes the groups its scheme routes (``parbench.model.moe``), which the caller passes
in (``Scheme.routing_groups``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..config import CaseConfig
from ..model import (GPTStage, build_model, clip_local_, eod_token, make_optimizer,
                     mask_prompts, pack_batch, synthetic_batch)
from ..model.moe import RoutingGroups, reset_step_loads, update_expert_bias
from ..model.router import expert_bias_state, load_state


@dataclass
class GoldenRun:
    losses: list[float] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    params: list[dict[str, torch.Tensor]] = field(default_factory=list)
    #: the model state beside the parameters after each step: the MoE routers' balancing
    #: biases (``model.router.expert_bias_state``; empty without them)
    states: list[dict[str, torch.Tensor]] = field(default_factory=list)
    #: "live" (trained in this process), "stored:<file>" (a committed golden file) or
    #: "stored:<file>+live" (its steps, then further steps trained here)
    source: str = "live"


def global_batch(case: CaseConfig, step: int):
    """Step ``step``'s global batch (inputs, targets): packed with documents when the model
    is (``model.packing.pack_batch``); with ``loss_mask``, the targets' prompt tokens masked
    (``model.data.mask_prompts``)."""
    x, y = synthetic_batch(case.model, case.layout.global_batch_size, case.run.seed, step)
    if case.model.pack_docs:
        x, y = pack_batch(x, y, case.model.pack_docs, eod_token(case.model), case.run.seed,
                          step)
    if case.run.loss_mask:
        y = mask_prompts(y, case.run.loss_mask, case.run.seed, step)
    return x, y


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


def train(case: CaseConfig, steps: int, routing: RoutingGroups | None = None,
          stored: GoldenRun | None = None) -> GoldenRun:
    """The golden run of ``case`` for ``steps`` steps, trained here ("live").

    With ``stored`` (the first k steps of a stored run: losses and gradients) steps 0..k-1
    are replayed instead of trained: the run's optimizer is applied to the stored gradients,
    which gives the parameters and the optimizer state of the live run exactly (the same
    elementwise arithmetic on the same tensors), the stored model state (the routers'
    balancing biases) is loaded, and steps k.. are trained on from there. A live step
    updates the biases from its loads after the optimizer (``moe.update_expert_bias``)."""
    torch.manual_seed(case.run.seed)
    model = reference_model(case, routing)
    opt = make_optimizer(model.parameters(), case.run)
    params = dict(model.named_parameters())
    have = len(stored.losses) if stored is not None else 0
    out = GoldenRun()
    for step in range(steps):
        if step < have:
            loss = stored.losses[step]
            for n, p in params.items():
                p.grad = stored.grads[step][n]
        else:
            loss = _forward_backward(model, opt, case, step)
        out.losses.append(loss)
        out.grads.append({n: p.grad.detach().clone() for n, p in params.items()})
        opt.step()
        if step < have:
            load_state(model, stored.states[step] if stored.states else {})
        else:
            update_expert_bias(model)
        out.params.append({n: t.detach().clone() for n, t in params.items()})
        out.states.append({n: t.detach().clone() for n, t in expert_bias_state(model).items()})
    return out


def _forward_backward(model: GPTStage, opt, case: CaseConfig, step: int) -> float:
    """Step ``step``'s loss on the global batch; its gradients left in ``.grad``, clipped by
    global norm when the run clips (``clip_grad``): the gradients the optimizer steps on, so a
    stored run replays them as they are."""
    x, y = global_batch(case, step)
    opt.zero_grad(set_to_none=True)
    reset_step_loads(model)
    loss = model(x, y)
    loss.backward()
    if case.run.clip_grad:
        clip_local_([p.grad for p in model.parameters()], case.run.clip_grad)
    return float(loss.detach())
