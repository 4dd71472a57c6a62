"""The auxiliary-loss-free balancing bias (DeepSeek-V3, arXiv 2412.19437, Sec. 2.1.2) of the
hybrid's MoE layers: each router's float32 bias ``[E]``, the step's loads and the update.

Every rank of a pipeline stage routes its own tokens (its dp rows, its cp positions, its tp
block of them), so the step's global load of a layer is the sum over the stage's tp x cp x dp
ranks -- Megatron-Core's ``tp_dp_cp`` group, over which its ``get_updated_expert_bias``
(megatron/core/transformer/moe/moe_utils.py) all-reduces ``tokens_per_expert``; ep only
re-partitions those ranks, so it adds nothing. Once per step, after the optimizer step, the
rank's loads of all its MoE layers (every micro-batch, before dropping) go in one all-reduce
of ``[L_moe on the rank, E]`` float32 on axis ``tp_dp_cp``, and each bias moves by
``parbench.model.router.updated_bias`` (the expert family's rule): the same bias on every
rank of the stage, equal to the golden model's.

Full recomputation runs an MoE layer twice per micro-batch; its loads are counted at the
first forward only (``counts``: the recomputed forward runs with gradients enabled inside
the backward, the first one without, ``impls.tensor.layers.Recompute``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from parbench.config import ConfigError
from parbench.model.router import BIAS_NAME, updated_bias

#: the mesh axis the loads are summed over (one pipeline stage's ranks)
LOAD_AXIS = "tp_dp_cp"


def check_bias(case, placement: str) -> None:
    """Refuse what the bias cannot follow the golden model under: a bidirectional schedule
    (two stage copies of the same layers, each with its own loads) and bf16 (a route on
    bf16 activations may choose another expert than the fp32 golden run; one load on the
    other side of the mean moves a bias by a whole gamma, and the state check is exact)."""
    rate = case.model.moe_bias_update_rate
    if not rate:
        return
    if placement == "bidirectional":
        raise ConfigError(f"moe_bias_update_rate={rate:g} with schedule="
                          f"{case.layout.schedule!r}: the two stage copies would each hold "
                          "a balancing bias of the same layers; use a unidirectional "
                          "schedule (or moe_bias_update_rate=0)")
    if case.run.dtype != "fp32":
        raise ConfigError(f"moe_bias_update_rate={rate:g} with dtype={case.run.dtype!r}: "
                          "the bias moves by sign(mean load - load), a discrete function of "
                          "routes that bf16 activations may change against the fp32 golden "
                          "run; use dtype=fp32 (or moe_bias_update_rate=0)")


def bias_name(i: int) -> str:
    """The reference model's name of layer ``i``'s balancing bias."""
    return f"blocks.{i}.mlp.router.{BIAS_NAME}"


class ExpertBias(nn.Module):
    """The balancing biases of one stage's MoE ``layers`` (none when ``rate`` is 0): float32
    buffers of a submodule of the stage, so that they move with it to its device."""

    def __init__(self, layers: list[int], num_experts: int, rate: float, recompute: str):
        super().__init__()
        self.rate, self.full_recompute = rate, recompute == "full"
        self.layers = list(layers) if rate else []
        for i in self.layers:
            self.register_buffer(f"layer{i}", torch.zeros(num_experts, dtype=torch.float32))
        #: plain numbers between the forwards and the update (no storage a memory tracker
        #: would count beside the biases, the closed form's "other")
        self.load = {i: [0] * num_experts for i in self.bias}

    @property
    def bias(self) -> dict[int, torch.Tensor]:
        """Layer -> its bias ``[E]``."""
        return {i: getattr(self, f"layer{i}") for i in self.layers}

    def of(self, i: int) -> torch.Tensor | None:
        return self.bias.get(i)

    def counts(self) -> bool:
        """Does this forward's routing count (not the re-run of full recomputation)?"""
        return not (self.full_recompute and torch.is_grad_enabled())

    def add(self, i: int, load: list[int]) -> None:
        """Layer ``i``'s assignments per expert of one micro-batch (before dropping)."""
        if i in self.bias and self.counts():
            self.load[i] = [a + b for a, b in zip(self.load[i], load)]

    def state(self) -> dict[str, torch.Tensor]:
        return {bias_name(i): b for i, b in self.bias.items()}


def local_loads(stages: list[ExpertBias]) -> torch.Tensor:
    """``[L_moe, E]``: the step's loads of every MoE layer of the rank's stages, in order."""
    device = next(iter(stages[0].bias.values())).device
    return torch.tensor([st.load[i] for st in stages for i in sorted(st.bias)],
                        dtype=torch.float32, device=device)


def global_load(local: torch.Tensor, mesh) -> torch.Tensor:
    """The loads summed over the stage's routing ranks (one all-reduce on ``LOAD_AXIS``)."""
    if mesh.size(LOAD_AXIS) > 1:
        dist.all_reduce(local, group=mesh.group(LOAD_AXIS))
    return local


def update_biases(stages: list[ExpertBias], mesh, reduce=global_load) -> None:
    """b += gamma sign(mean load - load) with the global loads; the loads are reset."""
    stages = [st for st in stages if st.bias]
    if not stages:
        return
    load = reduce(local_loads(stages), mesh)
    row = 0
    for st in stages:
        for i in sorted(st.bias):
            with torch.no_grad():
                st.bias[i].copy_(updated_bias(st.bias[i], load[row], st.rate))
            st.load[i] = [0] * len(st.load[i])
            row += 1
