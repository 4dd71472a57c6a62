"""torchtitan's DeepSeek-V3 (``torchtitan.models.deepseek_v3``, torchtitan 0.3.0) as a
framework under test: its own ``DeepSeekV3Model`` (``impls.baselines.torchtitan_dsv3_model``:
multi-head latent attention, DeepSeekMoE with the sigmoid router, the auxiliary-loss-free
bias, group-limited routing, shared experts -- DeepSeek-V3 Technical Report, arXiv
2412.19437, Sec. 2.1) parallelized by its own ``parallelize_deepseekv3`` on a dp x tp mesh
(ep x dp for the experts), compared with the golden run like every scheme.

What runs is ``baseline.torchtitan``'s (``impls.baselines.torchtitan``): torchtitan's
``ParallelDims`` meshes (its device type pointed at the rank's), FSDP2 on ``fsdp`` (and on
``efsdp`` for the experts under EP), TP + SP from the model's own sharding declarations
(``set_deepseek_v3_sharding_config``), its token-sum cross-entropy over the global token
count, the gradient sum over dp kept on gloo, parbench's AdamW on the local shards. EP is
torchtitan's ``AllToAllTokenDispatcher`` (``all_to_all_single`` on the ``ep`` mesh).

The balancing bias is torchtitan's own update: ``register_moe_load_balancing_hook`` registers
its pre-step hook on a stand-in for its optimizer container (``PreStepHooks``), called
before each optimizer step: the step's ``tokens_per_expert_E`` summed over the loss mesh
(dp) and, under EP with tp > 1, over tp.

Two findings (``known_finding``; reproducer ``scripts/torchtitan_dsv3_findings.py``) make its
MoE rows disagree with the golden run:

1. ``GroupedExperts.forward`` casts the tokens and the expert weights to bfloat16 for its
   grouped matmuls whatever the training dtype (fp32 here: ``mixed_precision_param``
   float32), so the routed experts' outputs and gradients carry bf16 rounding (~1e-2
   relative in the experts' gradients on ``deepseek-v3-tiny``);
2. the bias update is b += delta - mean(delta), delta = gamma sign(mean load - load): the
   mean of the update is removed, which the report's rule (b_i += gamma sign(mean load -
   load_i), Sec. 2.1.2) does not do (torchtitan's comment says it is "not exactly the same"
   as the paper's), so the bias state differs whenever the loads' signs do not cancel.
   Every bias of a layer moves by the same amount, so no choice of experts changes (the
   top-k and the groups' top-2 sums are shift-invariant, the gates use the unbiased
   scores): a difference of state, not of the function trained.

With the experts' grouped matmuls in fp32 (``torchtitan_dsv3_model.fp32_experts`` held open in
the ranks, a diagnostic) every layout's losses and gradients equal the golden run's and only
the bias state differs. The dense rows are equal to the golden run: ``mla-tiny`` (every layer dense) under FSDP2, TP +
SP and both. ``check_dsv3_case`` refuses what it cannot express.
"""
from __future__ import annotations

from parbench import comm
from parbench.config import CaseConfig, ConfigError
from parbench.moe_rules import MOE_FEATURES
from parbench.scheme import register

from impls.baselines import torchtitan_dsv3_model as dsv3
from impls.baselines.torchtitan import TorchTitan, check_titan_case, titan_parallelize

#: what torchtitan's DeepSeek-V3 model expresses (no grouped-query attention: MLA)
DSV3_FEATURES = frozenset({"rope", "swiglu", "rmsnorm", "no-bias", "mla"})


def check_dsv3_case(case: CaseConfig) -> None:
    """Refuse what torchtitan's DeepSeek-V3 cannot express: no MLA, MoE rules other than its
    router's (no capacity, no auxiliary losses, no router skew, every layer after the
    first dense ones an MoE layer, shared experts a multiple of a routed one), or widths its
    bf16 grouped matmul cannot take (rows of 16 bytes)."""
    m = case.model
    check_titan_case(case, "DeepSeek-V3")
    if not m.kv_lora_rank:
        raise ConfigError(f"kv_lora_rank={m.kv_lora_rank}: baseline.torchtitan.deepseek-v3's "
                          "attention is multi-head latent attention (set kv_lora_rank > 0)")
    if not m.num_experts:
        return
    expert = m.moe_ffn_hidden_size or m.ffn
    fixed = [("moe_every", m.moe_every, m.moe_every == 1, "1 (every layer after the "
              "first dense ones is MoE)"),
             ("moe_capacity_factor", m.moe_capacity_factor, m.moe_capacity_factor == 0,
              "0 (its router drops no token)"),
             ("moe_aux_loss_coef", m.moe_aux_loss_coef, m.moe_aux_loss_coef == 0,
              "0 (its MoE has no balancing loss)"),
             ("moe_z_loss_coef", m.moe_z_loss_coef, m.moe_z_loss_coef == 0, "0 (no z-loss)"),
             ("moe_router_skew", m.moe_router_skew, m.moe_router_skew == 0, "0 (no skew)"),
             ("moe_shared_expert_size", m.moe_shared_expert_size,
              m.moe_shared_expert_size % expert == 0,
              f"a multiple of the routed experts' {expert} (num_shared_experts)"),
             ("hidden_size", m.hidden_size, m.hidden_size % 8 == 0,
              "a multiple of 8 (bf16 grouped-mm rows of 16 bytes)"),
             ("moe_ffn_hidden_size", expert, expert % 8 == 0, "a multiple of 8 (bf16 "
              "grouped-mm rows of 16 bytes)")]
    for field, value, ok, rule in fixed:
        if not ok:
            raise ConfigError(f"{field}={value}: baseline.torchtitan.deepseek-v3 needs {rule}")
    lay = case.layout
    if lay.ep > 1 and lay.tp > 1 and lay.expert_tp != 1:
        raise ConfigError(f"etp={lay.etp} with ep={lay.ep}, tp={lay.tp}: torchtitan's EP "
                          "takes the tp ranks into its ep groups, experts whole (expert-tp "
                          "1); set etp=1")


class PreStepHooks:
    """Stands in for torchtitan's ``OptimizersContainer`` where
    ``register_moe_load_balancing_hook`` registers its bias update; ``run`` calls it."""

    def __init__(self):
        self.hooks = []

    def register_step_pre_hook(self, hook) -> None:
        self.hooks.append(hook)

    def run(self) -> None:
        for hook in self.hooks:
            hook()


@register
class TorchTitanDeepSeekV3(TorchTitan):
    name = "baseline.torchtitan.deepseek-v3"
    description = ("torchtitan 0.3.0 DeepSeekV3Model + parallelize_deepseekv3 (MLA, MoE; "
                   "FSDP2, TP+SP, EP all-to-all)")
    uses = ("dp", "tp", "ep")
    supports_moe = True
    model_features = DSV3_FEATURES
    moe_features = MOE_FEATURES
    known_finding = ("torchtitan 0.3.0's GroupedExperts computes the routed experts in bf16 "
                     "in fp32 training, and its bias update removes the update's mean "
                     "(b += delta - mean(delta); routing-neutral, the state differs from "
                     "DeepSeek-V3's rule): scripts/torchtitan_dsv3_findings.py")
    to_titan = staticmethod(dsv3.to_titan)
    from_titan = staticmethod(dsv3.from_titan)

    def build_titan(self):
        from torchtitan.models.deepseek_v3.sharding import set_deepseek_v3_sharding_config
        tcfg = dsv3.titan_config(self.ctx.model)
        set_deepseek_v3_sharding_config(tcfg, enable_sp=True,
                                        enable_ep=self.ctx.layout.ep > 1)
        return tcfg.build()

    def parallelize(self, model):
        from torchtitan.components.optimizer import register_moe_load_balancing_hook
        from torchtitan.models.deepseek_v3 import parallelize_deepseekv3
        model = titan_parallelize(parallelize_deepseekv3, model, self.dims)
        self.bias_hooks = PreStepHooks()
        register_moe_load_balancing_hook(self.bias_hooks, [model], self.dims)
        return model

    def step_local(self) -> None:
        """torchtitan's bias update (its optimizer pre-step hook), then the AdamW step."""
        with self.ctx.timeline.span("bias_update"):
            self.bias_hooks.run()
        super().step_local()

    def full_state(self):
        """The routers' balancing biases under parbench's names (replicated buffers)."""
        buffers = dict(self.model.named_buffers())
        out = {}
        with comm.unrecorded():
            for ours, theirs in dsv3.bias_names(self.ctx.model).items():
                b = buffers[theirs]
                out[ours] = (b.full_tensor() if hasattr(b, "full_tensor") else b).detach()
        return out

    @classmethod
    def check(cls, case: CaseConfig) -> None:
        super(TorchTitan, cls).check(case)
        check_dsv3_case(case)
        missing = cls.unavailable()
        if missing:
            raise ConfigError(f"scheme={cls.name}: {missing}")
