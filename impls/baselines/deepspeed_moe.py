"""DeepSpeed-MoE on the same case: ``deepspeed.moe.layer.MoE`` (Rajbhandari et al. 2022,
"DeepSpeed-MoE"; its gate and dispatch follow GShard's Algorithm 2) as every MoE layer of the
reference model, trained by a DeepSpeed engine (ZeRO stage 0, fp32, a client
``torch.optim.AdamW(foreach=False)``) that reduces the dense gradients over dp and the expert
gradients over DeepSpeed's expert-data-parallel groups, divided by the dense dp size
(``engine._reduce_expert_gradients``) -- the rule of ``expert.alltoall``.

Set-up: ``MoE(h, expert=MLP, num_experts=E, ep_size=ep, k, capacity_factor, min_capacity=0,
noisy_gate_policy=None, drop_tokens=True, use_rts=False, top2_2nd_expert_sampling=False)``
with the reference router (``gate.wg``) and experts (rank j of an ep group holds experts
j E/ep .., as ours) loaded; its tokens are the micro-batch flattened position-major, as
ours. Its process groups are the mesh's ep and edp groups, which are the groups DeepSpeed's
own rule builds for this world (``groups._get_expert_parallel_ranks``, asserted), handed to it
before the engine asks, so that its all-to-alls and reductions are booked to axes ep and edp
of the ledger. Each micro-batch's loss is the token cross-entropy plus
``moe_aux_loss_coef`` times the sum of the layers' ``l_aux``; the engine scales it by 1/m.

Where DeepSpeed 0.19.8's semantics differ from the reference MoE (``parbench.model.moe``), and
therefore which cases are comparable (``check``):

- **Dropping order.** Top-1 keeps, of an over-full expert's tokens, the ``torch.topk`` of a 0/1
  mask over the token axis (``top1gating``; with ``use_rts=False`` the "random" scores are
  that mask): among equal scores topk returns an implementation-defined subset, not the first
  tokens by position -- so no input order reproduces first-come dropping (seen: 196 of 200
  random routings of 32 tokens to 4 experts, capacity 8, keep another subset). Top-2 drops by
  position, as the reference, but renormalises the gates over the *kept* assignments (a token
  whose second choice is dropped gets gate 1), where the reference renormalises over the top-k
  before dropping. Comparable only where nothing can be dropped: capacity >= the tokens of a
  group, i.e. ``moe_capacity_factor = 0`` (no limit: DeepSpeed gets factor E/k, so its
  ceil(T/E * factor k) = T slots, the reference's C) or a factor with C >= T.
- **Top-2 load-balancing loss** counts first choices only, E sum_e P_e f_e^(1)
  (``top2gating``: mean(me * ce) E^2 with ce from mask1), where the reference counts all k T
  assignments (Switch Eq. 4 with top-k counts): top-2 only with ``moe_aux_loss_coef = 0``.
  Top-1: the same loss, E sum_e P_e f_e before dropping.
- **No router z-loss** (ST-MoE Eq. 5): ``moe_z_loss_coef = 0`` only.
- k in {1, 2} (k > 2 is ``topkgating`` with other rules); ``top2_2nd_expert_sampling`` off
  (its default adds Gumbel noise to the second choice).

Checked steps read the reduced gradients before ``engine.step()`` (outside the ledger) into
``self.captured``, a ``KeptForChecks`` (the tracker attributes it to ``checks``, beside
DeepSpeed's own states: it frees the gradients after the step); the other ep ranks' experts
are gathered for the verdict outside the ledger. Each case gets fresh ranks (``isolated``:
DeepSpeed keeps process-global groups).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from parbench import comm
from parbench.config import CaseConfig, ConfigError
from parbench.memory import KeptForChecks
from parbench.model import MLP, build_model
from parbench.model.moe import MoE as ReferenceMoE
from parbench.scheme import Scheme, register

from impls.baselines.deepspeed_common import stage0_engine
from impls.baselines.deepspeed_zero import _import_deepspeed, _MeshMPU
from impls.baselines.moe_checks import no_drop_capacity
from impls.expert.scheme import ExpertAllToAll



def ds_capacity_factor(cfg) -> float:
    """DeepSpeed's capacity factor for the case: its capacity is ceil(T/E * factor k)
    (``_capacity`` with ``capacity_factor * k`` for top-2), the reference's ceil(cf k T / E);
    the reference's "no limit" (cf = 0, C = T) is factor E / k."""
    cf = cfg.moe_capacity_factor
    return cf if cf > 0 else cfg.num_experts / cfg.moe_top_k


class DeepSpeedMoEBlock(nn.Module):
    """A block's MLP: DeepSpeed's MoE on the tokens flattened position-major; keeps its
    ``l_aux`` for the step to add to the loss."""

    def __init__(self, moe_class, ref: ReferenceMoE, cfg, ep: int, ep_rank: int):
        super().__init__()
        self.moe = moe_class(
            cfg.hidden_size, expert=MLP(cfg), num_experts=cfg.num_experts, ep_size=ep,
            k=cfg.moe_top_k, capacity_factor=ds_capacity_factor(cfg),
            eval_capacity_factor=ds_capacity_factor(cfg), min_capacity=0,
            noisy_gate_policy=None, drop_tokens=True, use_rts=False,
            top2_2nd_expert_sampling=False)
        local = cfg.num_experts // ep
        self.first = ep_rank * local
        with torch.no_grad():
            self.moe.deepspeed_moe.gate.wg.weight.copy_(ref.router.weight)
            for j, ex in enumerate(self.moe.deepspeed_moe.experts.deepspeed_experts):
                ex.load_state_dict(ref.experts[self.first + j].state_dict())
        self.l_aux = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        out, self.l_aux, _ = self.moe(x.transpose(0, 1).reshape(s * b, h))
        return out.view(s, b, h).transpose(0, 1)

    def names(self, prefix: str) -> dict[str, str]:
        """DeepSpeed's parameter names (under ``prefix``) -> the reference's."""
        out = {f"{prefix}moe.deepspeed_moe.gate.wg.weight": f"{prefix}router.weight"}
        for j, ex in enumerate(self.moe.deepspeed_moe.experts.deepspeed_experts):
            for n, _ in ex.named_parameters():
                out[f"{prefix}moe.deepspeed_moe.experts.deepspeed_experts.{j}.{n}"] = \
                    f"{prefix}experts.{self.first + j}.{n}"
        return out


def install_mesh_groups(groups, mesh, ep: int) -> None:
    """Hand DeepSpeed the mesh's ep and edp groups under its group name, after checking that
    they are the groups its own rule builds for this world (``_get_expert_parallel_ranks``)."""
    import torch.distributed as dist
    ep_ranks, edp_ranks = groups._get_expert_parallel_ranks(dist.get_world_size(), 1, ep)
    layout = mesh.layout
    if sorted(ep_ranks) != layout.groups("ep") or sorted(edp_ranks) != layout.groups("edp"):
        raise RuntimeError(f"DeepSpeed's expert groups {ep_ranks} / {edp_ranks} differ from "
                           f"the mesh's {layout.groups('ep')} / {layout.groups('edp')}")
    name = f"ep_size_{ep}"
    groups._EXPERT_PARALLEL_GROUP[name] = mesh.group("ep")
    groups._EXPERT_PARALLEL_GROUP_RANKS[name] = mesh.ranks("ep")
    groups._EXPERT_DATA_PARALLEL_GROUP[name] = mesh.group("edp")
    groups._EXPERT_DATA_PARALLEL_GROUP_RANKS[name] = mesh.ranks("edp")


@register
class DeepSpeedMoE(ExpertAllToAll):
    name = "baseline.deepspeed.moe"
    baseline_of = "expert.alltoall"
    model_features = ExpertAllToAll.BASELINE_FEATURES
    isolated = True
    description = "DeepSpeed deepspeed.moe.layer.MoE (ep groups of the mesh) + engine, ZeRO-0"

    @classmethod
    def check(cls, case: CaseConfig) -> None:
        super().check(case)
        m = case.model
        if m.moe_top_k not in (1, 2):
            raise ConfigError(f"moe_top_k={m.moe_top_k}: {cls.name} runs top-1 or top-2 "
                              "(DeepSpeed's top-k > 2 gate has other rules)")
        if m.moe_z_loss_coef:
            raise ConfigError(f"moe_z_loss_coef={m.moe_z_loss_coef}: {cls.name} has no router "
                              "z-loss; set moe_z_loss_coef=0")
        if m.moe_top_k == 2 and m.moe_aux_loss_coef:
            raise ConfigError(f"moe_aux_loss_coef={m.moe_aux_loss_coef} with moe_top_k=2: "
                              f"{cls.name}'s top-2 balancing loss counts first choices only; "
                              "set moe_aux_loss_coef=0")
        no_drop_capacity(cls.name, case)
        if case.run.optimizer != "adamw":
            raise ConfigError(f"optimizer={case.run.optimizer!r}: {cls.name} runs adamw only")

    def __init__(self, ctx):
        Scheme.__init__(self, ctx)  # not the native __init__: the engine owns grads, optimizer
        ds = _import_deepspeed()
        from deepspeed.moe.layer import MoE as DeepSpeedMoELayer
        from deepspeed.utils import groups
        mesh, cfg = ctx.mesh, ctx.model
        self.dp, self.dp_rank = mesh.size("dp"), mesh.index("dp")
        self.ep, self.ep_rank = mesh.size("ep"), mesh.index("ep")
        install_mesh_groups(groups, mesh, self.ep)
        model = build_model(cfg, ctx.run.seed)
        self.blocks: list[DeepSpeedMoEBlock] = []
        self._names: dict[str, str] = {}
        for i, blk in model.blocks.items():
            if isinstance(blk.mlp, ReferenceMoE):
                blk.mlp = DeepSpeedMoEBlock(DeepSpeedMoELayer, blk.mlp, cfg, self.ep,
                                            self.ep_rank)
                self.blocks.append(blk.mlp)
                self._names.update(blk.mlp.names(f"blocks.{i}.mlp."))
        self.engine = stage0_engine(ds, model.to(ctx.device), ctx, _MeshMPU(mesh))
        self.captured = KeptForChecks()  # the gradients a checked step used (full_grads)

    def _named(self):
        return [(self._names.get(n, n), p) for n, p in self.engine.module.named_parameters()]

    def train_step(self, inputs, targets, step):
        mbs = self.local_microbatches(inputs, targets)
        m = len(mbs)
        tl = self.ctx.timeline
        coef = self.ctx.model.moe_aux_loss_coef
        total = 0.0
        for i, (xm, ym) in enumerate(mbs):
            with tl.span("F", mb=i):
                ce = self.engine(xm, ym)
                loss = ce + coef * sum(b.l_aux for b in self.blocks)
            with tl.span("B", mb=i):
                self.engine.backward(loss)
            for b in self.blocks:
                b.l_aux = None
            total += float(ce.detach()) / m
            if i == m - 1 and step < self.ctx.run.steps:
                with comm.unrecorded():
                    self.captured = KeptForChecks(
                        (n, p.grad.detach().clone()) for n, p in self._named())
            with tl.span("optim" if i == m - 1 else "step", mb=i):
                self.engine.step()
        return self.reduce_loss(total / self.dp, self.ctx.mesh.group("dp"))

    def full_params(self):
        return self._gathered({n: p.detach().clone() for n, p in self._named()})

    def full_grads(self):
        return self._gathered(self.captured)

    def metrics(self):
        return {}
