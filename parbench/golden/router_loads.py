"""The single-device reference router's token counts on a case's data: the data-dependent
input of the closed forms of the dropless, shadow-expert and Tutel schemes
(``analytic.expert_dropless``, ``analytic.expert_shadow``, ``analytic.expert_tutel``), never
read from an implementation's ledger. The scheme's ``predict`` computes them and hands them
to the closed form, which stays pure arithmetic.

For checked step t the reference model (``parbench.model``) holds the parameters of the golden
run before step t (its seeded initialisation for t = 0, the golden run's updated parameters and
routers' balancing biases of step t - 1 after), runs forward on step t's global batch, cut into the scheme's routing groups
(``Scheme.routing_groups``), and each MoE layer's router reports how many assignments each
group sends to each expert (``parbench.model.moe.route``'s ``group_load``).
"""
from __future__ import annotations

import torch

from ..config import CaseConfig
from ..model.moe import MoE, RoutingGroups
from ..model.router import load_state
from .key import golden_key
from .run import global_batch, reference_model
from .store import reference_run

_CACHE: dict[str, list] = {}


def reference_loads(case: CaseConfig, steps: int, routing: RoutingGroups
                    ) -> list[list[list[list[int]]]]:
    """``loads[step][moe_layer][group][expert]`` for the first ``steps`` steps of ``case``,
    routed in the groups ``routing`` (groups in ascending id: for one group per rank and
    micro-batch, dp rank q's micro-batch i is group q m + i)."""
    key = f"{steps}:{golden_key(case, routing)}"
    if key not in _CACHE:
        if len(_CACHE) > 16:
            _CACHE.clear()
        _CACHE[key] = _trace(case, steps, routing)
    return _CACHE[key]


def _trace(case: CaseConfig, steps: int, routing: RoutingGroups) -> list:
    golden = reference_run(case, steps, routing)
    model = reference_model(case, routing)
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    out = []
    with torch.no_grad():
        for step in range(steps):
            if step:
                for name, p in model.named_parameters():
                    p.copy_(golden.params[step - 1][name])
                load_state(model, golden.states[step - 1])
            x, y = global_batch(case, step)
            model(x, y)
            out.append([m.last["group_load"].tolist() for m in layers])
    return out
