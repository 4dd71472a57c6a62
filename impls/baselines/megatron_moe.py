"""Megatron-Core 0.16's MoE layer on the same case: ``megatron.core.transformer.moe.moe_layer
.MoELayer`` (``TopKRouter``, ``MoEAlltoAllTokenDispatcher``, ``SequentialMLP`` experts) as
every MoE layer of the reference model, compared with ``expert.alltoall``.

**It does not run on a CPU-only torch as shipped.** Three places assume CUDA:

1. ``MoEAlltoAllTokenDispatcher.__init__`` creates ``torch.cuda.Stream()`` (its device-to-host
   copy stream), which raises "torch.cuda.Stream requires CUDA support"; the dispatch then
   records events on that stream and enters ``torch.cuda.stream(...)``;
2. ``TopKRouter.gating`` moves a router weight that lives on the CPU to
   ``torch.cuda.current_device()`` on every call;
3. ``moe_utils.RouterGatingLinearFunction.forward`` reads the module global ``te_general_gemm``,
   which is never defined when TransformerEngine is not installed (``NameError``).

On a CPU-only torch parbench installs shims in the (isolated) rank processes, changing none of
Megatron's arithmetic: a do-nothing stream object as the dispatcher's class attribute
``cuda_dtoh_stream``, ``torch.cuda.current_device`` / ``current_stream`` / ``stream`` answering
for the CPU, and ``te_general_gemm = None`` (the value the module means without
TransformerEngine). Even so its *dropless* dispatch (``moe_expert_capacity_factor=None``) does
not run on the CPU: its split sizes stay tensors (the device-to-host conversion happens only on
a CUDA synchronisation point) and gloo's ``all_to_all_single`` rejects them. So parbench runs
its **capacity mode** (``moe_expert_capacity_factor`` with ``moe_pad_expert_input_to_capacity``):
every expert gets exactly C rows per rank, GShard's padded buffer, the layout of ours. With one
expert-parallel rank (ep = 1) its expert MLP fails in autograd (``mlp.py`` adds the bias in
place, ``output += output_bias * per_token_scale``, to a view returned by
``_ReduceFromModelParallelRegion``), so ep >= 2.

What it measures differently (findings, not errors): the gate probabilities travel with the
tokens -- its experts scale their outputs on the expert's rank (``per_token_scale``), so each
MoE layer adds an all-to-all of the E C probabilities forward and of their gradient backward
(6 all-to-alls per layer per micro-batch where GShard and ours have 4); and the dispatcher keeps
routing tensors between steps (``other`` model-state bytes).

Semantics against the reference MoE (``parbench.model.moe``), and which cases are comparable
(``check``): router without bias (the reference's; Megatron's ``add_bias_linear`` bias is
removed), top-1 gate = the chosen expert's probability (``moe_router_pre_softmax``), top-2
gates = the top-2 probabilities renormalised (its default), the Switch balancing loss with
top-k counts (``switch_load_balancing_loss_func``: E sum_e P_e f_e, f_e over the k T
assignments before dropping, per micro-batch as ``aux_loss``) and the ST-MoE z-loss, both
through ``MoEAuxLossAutoScaler`` with scale 1/m -- the reference's. Its capacity is
ceil(T k / E x factor), the reference's C. Its dropping, though, keeps per expert the
``torch.topk`` of the routing map over the tokens ("position" policy) -- an
implementation-defined subset among equal scores, with no first-choices-first priority -- so
only cases where nothing can be dropped compare (C >= T; the reference's no limit, cf = 0, is
factor E/k, C = T). Gradients are reduced as ``expert.alltoall`` does (Megatron's
``DistributedDataParallel`` is not used): this baseline checks Megatron's layer -- routing,
dispatch, experts, combine, losses -- not its gradient buffers.

Optional: ``pip install -e ".[megatron]"``; without megatron-core the scheme reports itself
unavailable. Each case runs in fresh processes (``isolated``: the shims and Megatron's
auxiliary-loss scale are process-global).
"""
from __future__ import annotations

import contextlib
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

from parbench.config import CaseConfig, ConfigError
from parbench.model import build_model
from parbench.model.moe import MoE as ReferenceMoE
from parbench.scheme import register

from impls.baselines.deepspeed_moe import ds_capacity_factor
from impls.baselines.megatron_tp import megatron_core_missing
from impls.baselines.moe_checks import no_drop_capacity
from impls.expert.scheme import ExpertAllToAll

# Megatron-Core's fallbacks and defaults on this install, announced on every rank
warnings.filterwarnings("ignore", message=".*moe_ffn_hidden_size is not set")
warnings.filterwarnings("ignore", message=".*Apex is not installed")
warnings.filterwarnings("ignore", message=".*full scope is deprecated")


class _NoStream:
    """Stands for a CUDA stream or event on the CPU: every wait is already satisfied."""

    def wait_stream(self, *a):
        pass

    def synchronize(self):
        pass

    def record_event(self, *a):
        return self

    def wait(self, *a):
        pass

    def query(self):
        return True


def install_cpu_shims() -> None:
    """The module docstring's three CPU shims (a no-op where CUDA is available)."""
    if torch.cuda.is_available():
        return
    import megatron.core.transformer.moe.moe_utils as moe_utils
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _NoStream()
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.current_stream = lambda *a, **k: _NoStream()
    torch.cuda.stream = lambda s: contextlib.nullcontext()


def process_groups(mesh):
    """Megatron-Core's ``ProcessGroupCollection`` from the mesh's groups; its
    tensor-and-expert group (``tp_ep``) is the ep group where expert-tp is 1, else
    :func:`tensor_and_expert_group`."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    pg = ProcessGroupCollection()
    g = mesh.group
    pg.tp, pg.cp, pg.tp_cp, pg.dp, pg.dp_cp = g("tp"), g("cp"), g("tp_cp"), g("dp"), g("dp_cp")
    pg.tp_dp_cp = g("tp_dp_cp")
    pg.ep, pg.expt_tp, pg.expt_dp = g("ep"), g("etp"), g("edp")
    pg.tp_ep = g("ep") if mesh.size("etp") == 1 else tensor_and_expert_group(mesh)
    return pg


def tensor_and_expert_group(mesh):
    """Megatron-Core's tensor-and-expert-parallel group: the etp x ep ranks that share their
    expert-dp and pipeline coordinates (``parallel_state``: the expert grid's order
    etp-ep-edp-pp), taken from the mesh as subgroup ``tp_ep`` (its traffic's axis)."""
    from itertools import product

    from parbench.layout import EXPERT_ORDER
    lay = mesh.layout
    size = lay.sizes(EXPERT_ORDER)
    parts = [[lay.rank_of(EXPERT_ORDER, etp=t, ep=e, edp=d, pp=p)
              for e, t in product(range(lay.ep), range(lay.expert_tp))]
             for p, d in product(range(lay.pp), range(size["edp"]))]
    return mesh.subgroup("tp_ep", parts)


def transformer_config(cfg, ep: int):
    from megatron.core.transformer.transformer_config import TransformerConfig
    return TransformerConfig(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_heads, ffn_hidden_size=cfg.ffn,
        num_moe_experts=cfg.num_experts, moe_router_topk=cfg.moe_top_k,
        moe_router_pre_softmax=cfg.moe_top_k == 1, moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=cfg.moe_aux_loss_coef,
        moe_z_loss_coeff=cfg.moe_z_loss_coef or None, moe_router_dtype="fp32",
        moe_token_dispatcher_type="alltoall", moe_expert_capacity_factor=ds_capacity_factor(cfg),
        moe_pad_expert_input_to_capacity=True, moe_token_drop_policy="position",
        expert_model_parallel_size=ep, add_bias_linear=True, gated_linear_unit=False,
        activation_func=F.gelu, bias_activation_fusion=False, use_cpu_initialization=True,
        params_dtype=torch.float32, perform_initialization=False)


class MegatronMoEBlock(nn.Module):
    """A block's MLP: Megatron-Core's ``MoELayer`` on ``[s, b, h]`` (its token order is the
    reference's position-major order), loaded with the reference router and experts."""

    def __init__(self, ref: ReferenceMoE, config, pg, ep_rank: int, layer: int):
        super().__init__()
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.moe.moe_layer import MoELayer
        spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts,
                                        moe_grouped_gemm=False)
        self.moe = MoELayer(config, spec.submodules.mlp.submodules, pg_collection=pg)
        self.moe.router.bias = None  # the reference router has no bias
        local = len(self.moe.experts.local_experts)
        self.first = ep_rank * local
        with torch.no_grad():
            self.moe.router.weight.copy_(ref.router.weight)
            for j, ex in enumerate(self.moe.experts.local_experts):
                src = ref.experts[self.first + j]
                for mine, theirs in ((ex.linear_fc1, src.fc1), (ex.linear_fc2, src.fc2)):
                    mine.weight.copy_(theirs.weight)
                    mine.bias.copy_(theirs.bias)
        self.prefix = f"blocks.{layer}.mlp."

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, bias = self.moe(x.transpose(0, 1).contiguous())
        if bias is not None:
            out = out + bias
        return out.transpose(0, 1)

    def names(self) -> dict[str, str]:
        """Megatron's parameter names (under the block) -> the reference's."""
        p, out = self.prefix, {f"{self.prefix}moe.router.weight": f"{self.prefix}router.weight"}
        for j, _ in enumerate(self.moe.experts.local_experts):
            for mine, ours in (("linear_fc1", "fc1"), ("linear_fc2", "fc2")):
                for t in ("weight", "bias"):
                    out[f"{p}moe.experts.local_experts.{j}.{mine}.{t}"] = \
                        f"{p}experts.{self.first + j}.{ours}.{t}"
        return out


@register
class MegatronMoE(ExpertAllToAll):
    name = "baseline.megatron.moe"
    baseline_of = "expert.alltoall"
    model_features = ExpertAllToAll.BASELINE_FEATURES
    isolated = True
    description = "Megatron-Core 0.16 MoELayer (alltoall dispatcher, capacity mode)"

    @classmethod
    def unavailable(cls) -> str | None:
        return megatron_core_missing()

    @classmethod
    def check(cls, case: CaseConfig) -> None:
        super().check(case)
        m, p = case.model, case.layout
        if p.ep == 1:
            raise ConfigError(f"ep=1: {cls.name} fails inside Megatron-Core 0.16 with one "
                              "expert-parallel rank (mlp.py adds the expert bias in place to "
                              "a view autograd forbids); set ep >= 2")
        tokens = p.micro_batch_size * m.seq_length
        c = no_drop_capacity(cls.name, case)
        if c > tokens and m.moe_capacity_factor:
            raise ConfigError(f"moe_capacity_factor={m.moe_capacity_factor} gives capacity "
                              f"{c} > {tokens} tokens: {cls.name} pads to at most the tokens "
                              "(set moe_capacity_factor=0)")

    def build_local_model(self) -> nn.Module:
        install_cpu_shims()
        ctx = self.ctx
        config = transformer_config(ctx.model, self.ep)
        pg = process_groups(ctx.mesh)
        model = build_model(ctx.model, ctx.run.seed)
        self._names: dict[str, str] = {}
        for i, blk in model.blocks.items():
            if isinstance(blk.mlp, ReferenceMoE):
                blk.mlp = MegatronMoEBlock(blk.mlp, config, pg, self.ep_rank, int(i))
                self._names.update(blk.mlp.names())
        return model

    def named_parameters(self):
        return [(self._names.get(n, n), p) for n, p in self.model.named_parameters()]

    def set_aux_scale(self, m: int) -> None:
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0 / m))

    def metrics(self):
        return {}
