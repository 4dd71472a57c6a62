"""Megatron-Core 0.16's whole ``GPTModel`` with MoE layers under expert parallelism, against
``expert.alltoall`` (issue 21): ``baseline.megatron.gpt-moe``.

The model is ``baseline.megatron.gpt``'s (``megatron_gpt.MegatronCoreGPTModel``: the local
layer spec, the case's model as a ``TransformerConfig``, the reference weights mapped by
name) with ``num_moe_experts`` set and Megatron-Core's decoder block spec
(``get_gpt_decoder_block_spec``, no TransformerEngine): its ``moe_layer_freq`` is the
reference's MoE layers (``model.moe.is_moe_layer``: the first ``moe_first_dense`` dense,
then every ``moe_every``-th), each MoE layer's MLP Megatron-Core's ``MoELayer``
(``TopKRouter``, ``MoEAlltoAllTokenDispatcher``, ``SequentialMLP`` experts), the others its
dense ``MLP`` (the local specs). The MoE settings, their CPU shims
and the comparable cases are ``baseline.megatron.moe``'s (``megatron_moe``: capacity mode --
dropless split sizes break gloo --, router without bias, top-1 pre-softmax, the Switch and
z-losses through ``MoEAuxLossAutoScaler`` at 1/m, ep >= 2, nothing dropped); here Megatron
also runs the attention, norms, embedding, rotary and vocab-parallel cross-entropy around
them. Fine-grained experts (``moe_ffn_hidden_size``) run. Expert e of E sits on ep rank
e // (E/ep) as local expert e mod (E/ep) (Megatron-Core's ``SequentialMLP``: the
``local_expert_indices`` of its ep rank are contiguous).

Shared expert (DeepSeekMoE, Dai et al. 2024 Sec. 3.2; DeepSeek-V3 Eq. 12): Megatron-Core's
``SharedExpertMLP`` (shared_experts.py) is an ``MLP`` whose ``ffn_hidden_size`` is
``moe_shared_expert_intermediate_size`` (the reference's ``moe_shared_expert_size``: the
shared experts' total width), ungated, its output added to the routed one, split over tp as
the dense MLP; it asserts ``add_bias_linear`` off, so shared-expert cases are bias-free
(``check``). Every expert MLP is placed at its own width (the model module's
``MoELayout``, ``megatron_gpt_moe_model``): placed at the dense width, a narrower expert's
fc1 index read rows past its own (zero padding) -- the "64 vs 128" size mismatch of the
first attempt was parbench's placement, not Megatron's arithmetic.

DeepSeek-V3's router (``parbench.model.router``) is Megatron-Core's own (the model module's
``router_fields``): the sigmoid score function, group-limited routing (Megatron scores a
group by its top k/topk_groups scores, the reference by its top 2: k = 2 topk_groups only),
the routed scaling factor. Its balancing loss under group-limited routing counts each
token's top-k of all experts by the unbiased scores (``compute_routing_scores_for_aux_loss``,
DeepSeek-V3's Eq. 18), as the reference now does (``parbench.model.router.balance_choice``;
the reference counted the routed experts before, which this baseline showed: router
gradients off by 1.3e-6 at alpha 1e-4, 1.3e-4 at 1e-2). One part computes differently
(``check_router``):

- the auxiliary-loss-free bias (a finding, ``baseline.megatron.gpt-moe-bias``): Megatron
  counts its load from the routing map after ``apply_router_token_dropping``, which in
  capacity mode with padding is the capacity mask, so every expert counts its capacity and
  the bias never moves (``scripts/megatron_expert_bias_capacity_repro.py``). That scheme
  updates it with Megatron's ``_update_router_expert_bias`` (its counts all-reduced over
  ``parallel_state``'s tp x dp x cp group, the mesh's) and compares it.

deepseek-tiny as Megatron-Core compares (``DEEPSEEK_TINY``): its first dense layer, 8
fine-grained routed experts of 16 and one shared expert of 16, the sigmoid router over 2
groups of 4 keeping 1, top-2, SwiGLU without biases, its balancing loss; no bias.

tp x ep: Megatron-Core's ``MoELayer`` raises in training when tp > 1 without sequence
parallelism, so tp > 1 needs ``sp=true`` and runs with CPU shim 5
(``megatron_gpt.SequenceParallelTorchNorm``, the local spec's norms marked
``sequence_parallel``). The experts are split over expert-tp = tp (Megatron's default;
``etp`` 0), whose group has the tp group's ranks (the expert order etp-ep-edp puts etp
fastest, as the dense order tp): fc1 column- and fc2 row-parallel at the expert's width.
Its ``tp_ep`` group (the etp x ep ranks) is the mesh's subgroup of that name
(``megatron_moe.tensor_and_expert_group``). Each rank routes its s/tp tokens, so the
capacity and the all-to-all buffers are 1/tp of tp = 1's; after the ep all-to-all the
expert-tp group all-gathers the tokens and probabilities and reduce-scatters the outputs
before the combine. The parameters Megatron marks ``sequence_parallel`` (the norms and every
router's weight) have partial gradients per tp rank: summed over tp in one all-reduce
before the dense dp reduction, as ``finalize_model_grads`` does. Megatron-Core's DDP is not
used here either.

Process groups: the mesh's (``megatron_moe.process_groups``: tp, cp, dp, ep and the expert
groups), one-rank groups for pp and the embedding groups (no pipeline). Gradients are reduced
as ``expert.alltoall`` does (dense over dp, experts over edp), as by
``baseline.megatron.moe``. The verdict sees the reference's names and row order: tp shards
gathered over tp, and at tp = 1 the linear_qkv rows put back from Megatron's
group-interleaved order (the model module's ``unshard``).

Measured (tiny, E = 4, top-1, ep = dp = 2, m = 2; the same as ``baseline.megatron.moe``):
equivalent to the golden run; 24 all-to-alls per rank and step where ``expert.alltoall``'s
closed form has 16, ep wire bytes 133,120 against 131,072 (+2,048 = 2 L m (ep-1)/ep E C 4 B,
L = 2 MoE layers, C = 32: the gate probabilities each way), the dp all-reduce exactly the
closed form (70,912 B); its cross-entropy's all-reduces on the one-rank tp group (6 calls,
no wire bytes); 3,520 B of ``other`` model state (the dispatcher's routing tensors).
deepseek-tiny (``DEEPSEEK_TINY``: 3 layers, the first dense), ep = dp = 2: equivalent;
dp 121,728 B and the parameter, gradient and optimizer states exactly the closed form; ep
266,240 B against 262,144 (+4,096, the probabilities, E = 8). The same at tp = 2 (sp,
ep = dp = 2, 4 ranks): equivalent; ep 133,120 B = (262,144 + 4,096) / tp; etp 266,240 B in
24 calls = 2 L m (t-1)(2 E C h + E C) 4 / t B (the all-gathers and reduce-scatters above);
tp 147,072 B in 77 calls: sequence parallelism's 42 all-gathers and 28 reduce-scatters of
4,096 B (21 and 14 per micro-batch: the 7 column-parallel inputs -- qkv of 3 layers, the
dense fc1, the shared experts' fc1, the output layer -- gathered forward and again backward
for their weight gradients, the 7 row-parallel outputs and the embedding scattered), the
cross-entropy's 6 all-reduces, and one all-reduce of the ``sequence_parallel`` gradients
(2,944 B: 7 norms and 2 routers); dp 62,336 B; 86,912 B of parameters per rank where
tp = 1 holds 170,880 (mixtral-tiny, with its balancing loss, adds tp_cp 256 B in 4 calls:
the routers' token counts summed over the sequence shards). Beside ``expert.alltoall``'s closed form, which is
tp = 1's (no native scheme splits experts over tp: ``hybrid`` keeps them whole, etp = 1),
these are '≠', a framework's difference shown. tiny-4l with an MoE layer every other
layer (ep = dp = 2): equivalent, dp exactly the closed form.

Megatron-LM issue 7452 (silent composition bugs, reproduced on CPU / gloo): its GPTModel
MoE reproduction is a router ``padding_mask`` on the wrong tp group; no case here passes a
padding mask (``loss_mask`` is refused), so it does not apply.

Optional: ``pip install -e ".[megatron]"``; without megatron-core the scheme reports itself
unavailable. Each case runs in fresh processes (``isolated``).
"""
from __future__ import annotations

from typing import ClassVar

import torch.nn as nn

from parbench.config import CaseConfig, ConfigError
from parbench.scheme import register

from impls.baselines import megatron_moe
from impls.baselines.megatron_gpt import check_query_groups, no_cuda_rng_fork
from impls.baselines.megatron_gpt_moe_model import MegatronCoreMoEGPT
from impls.baselines.megatron_moe import MegatronMoE
from impls.baselines.megatron_tp import _set_parallel_state
from impls.tensor.collectives import all_reduce_flat

#: deepseek-tiny as Megatron-Core compares with the reference (overrides): its first dense
#: layer (``moe_layer_freq``), fine-grained routed experts and shared expert, the sigmoid
#: router with group-limited routing (2 groups of 4, 1 kept, top-2), SwiGLU without biases
#: (SharedExpertMLP refuses biases), its balancing loss (alpha 1e-4); without its balancing
#: bias (Megatron-Core's never moves in capacity mode: baseline.megatron.gpt-moe-bias).
DEEPSEEK_TINY = {"model": "deepseek-tiny", "num_experts": "8", "bias": "false",
                 "mlp": "swiglu", "moe_bias_update_rate": "0"}


@register
class MegatronCoreGPTMoE(MegatronMoE):
    name = "baseline.megatron.gpt-moe"
    #: DeepSeek-style experts Megatron-Core's local spec builds comparably (issue 21)
    moe_features = frozenset({"fine-grained", "llama-experts", "shared-expert", "first-dense",
                              "sigmoid-router", "expert-bias", "group-limited",
                              "router-scaling"})
    #: the LLaMA blocks and Mixtral's experts (SwiGLU, no biases), Megatron's own MLPs
    model_features = frozenset({"rope", "gqa", "rmsnorm", "swiglu", "no-bias"})
    #: tp x ep: Megatron's expert-tp default (= tp) with sequence parallelism (shim 5)
    uses = ("tp", "ep", "dp")
    options = (*MegatronMoE.options, "sp")
    experts_split_over_tp = True
    #: the routers' balancing bias is compared by baseline.megatron.gpt-moe-bias only
    runs_expert_bias: ClassVar[bool] = False
    model_cls = MegatronCoreMoEGPT
    description = ("Megatron-Core 0.16 GPTModel with MoELayer (local spec, alltoall "
                   "dispatcher, capacity mode) with the reference weights")

    @classmethod
    def check(cls, case: CaseConfig) -> None:
        m = case.model
        if m.moe_shared_expert_size and m.bias:
            raise ConfigError(f"moe_shared_expert_size={m.moe_shared_expert_size} with "
                              "bias=true: Megatron-Core 0.16.1's SharedExpertMLP asserts 'bias "
                              "is not supported in the shared experts'; set bias=false")
        super().check(case)
        if m.num_experts % case.layout.ep:
            raise ConfigError(f"ep={case.layout.ep} does not divide "
                              f"num_experts={m.num_experts}")
        cls.check_tensor_parallel(case)
        cls.check_router(case)

    @classmethod
    def check_router(cls, case: CaseConfig) -> None:
        """Megatron-Core's rules for DeepSeek's router (transformer_config.py), and where its
        group score is the reference's (``parbench.model.router``: k = 2 topk_groups)."""
        m = case.model
        if m.moe_bias_update_rate and not cls.runs_expert_bias:
            raise ConfigError(f"moe_bias_update_rate={m.moe_bias_update_rate}: {cls.name} does "
                              "not compare the balancing bias (Megatron-Core 0.16.1 counts the "
                              "capacity-padded routing map, so the bias never moves: the "
                              "finding of baseline.megatron.gpt-moe-bias); set "
                              "moe_bias_update_rate=0")
        if m.moe_bias_update_rate and m.moe_router != "sigmoid":
            raise ConfigError(f"moe_bias_update_rate={m.moe_bias_update_rate} with moe_router="
                              f"{m.moe_router}: Megatron-Core's expert bias only supports the "
                              "sigmoid score function; set moe_router=sigmoid")
        tg = m.moe_router_topk_groups
        if m.moe_router_groups and m.moe_top_k != 2 * tg:
            raise ConfigError(f"moe_top_k={m.moe_top_k}, moe_router_topk_groups={tg}: "
                              "Megatron-Core scores a group by its top k/topk_groups scores, "
                              "the reference by its top 2; set moe_top_k = 2 topk_groups")

    @classmethod
    def check_tensor_parallel(cls, case: CaseConfig) -> None:
        """tp > 1: Megatron-Core's ``MoELayer`` raises in training without sequence
        parallelism (moe_layer.py), which splits the sequence over tp; its attention splits
        the query groups."""
        t = case.layout.tp
        if t == 1:
            return
        if not case.options.tensor.sp:
            raise ConfigError(f"tp={t} with sp=false: Megatron-Core 0.16.1's MoELayer "
                              "requires sequence parallelism when tp > 1; set sp=true")
        if case.model.seq_length % t:
            raise ConfigError(f"tp={t} must divide seq_length={case.model.seq_length} "
                              "(sequence parallelism)")
        check_query_groups(case)

    def build_local_model(self) -> nn.Module:
        megatron_moe.install_cpu_shims()
        ctx = self.ctx
        _set_parallel_state(ctx.mesh.group("tp"), ctx.device)
        from megatron.core import parallel_state as ps
        # get_updated_expert_bias all-reduces the counts over this global group
        ps._TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP = ctx.mesh.group("tp_dp_cp")
        no_cuda_rng_fork()
        return self.model_cls(ctx.model, ctx.run.seed, ctx.mesh, self.ep, self.ep_rank,
                              ctx.options.tensor.sp)

    def reduce_dense_gradients(self) -> None:
        """With sequence parallelism first the ``sequence_parallel`` parameters' gradients
        summed over tp in one all-reduce (as Megatron-Core's ``finalize_model_grads``), then
        the dense mean over dp."""
        if self.ctx.mesh.size("tp") > 1:
            all_reduce_flat(self.model.sequence_parallel_grads(), self.ctx.mesh.group("tp"))
        super().reduce_dense_gradients()

    def update_bias(self, per_layer) -> None:
        """Megatron-Core's own step-end update of the routers' balancing biases
        (``finalize_model_grads``: the step's token counts all-reduced over tp x dp, then
        ``get_updated_expert_bias``; the counts reset)."""
        if not self.ctx.model.moe_bias_update_rate:
            return
        from megatron.core.distributed.finalize_model_grads import (
            _update_router_expert_bias, reset_model_temporary_tensors)
        gpt = self.model.gpt
        with self.ctx.timeline.span("bias_update"):
            _update_router_expert_bias([gpt], gpt.config)
            reset_model_temporary_tensors(gpt.config, [gpt])

    def full_state(self):
        """The routers' balancing biases under the reference's names."""
        if not self.ctx.model.moe_bias_update_rate:
            return {}
        return {n.replace("gpt.decoder.layers.", "blocks.", 1): b.detach()
                for n, b in self.model.named_buffers() if n.endswith(".router.expert_bias")}

    def named_parameters(self):
        return [(n, p) for n, (p, _) in self.model.shards().items()]

    def full_params(self):
        return self._gathered(self.model.reference_named())

    def full_grads(self):
        return self._gathered(self.model.reference_named(grads=True))


@register
class MegatronCoreGPTMoEBias(MegatronCoreGPTMoE):
    """``baseline.megatron.gpt-moe`` with DeepSeek-V3's auxiliary-loss-free balancing bias
    (Megatron-Core's ``moe_router_enable_expert_bias``, updated by its
    ``finalize_model_grads`` functions): a known finding, kept apart so that it labels only
    these rows."""

    name = "baseline.megatron.gpt-moe-bias"
    runs_expert_bias = True
    known_finding = ("Megatron-Core 0.16.1 counts the expert bias's load from the routing map "
                     "after apply_router_token_dropping; with moe_pad_expert_input_to_capacity "
                     "that map is the capacity mask (every expert = its capacity), so the "
                     "counts are uniform and the bias never moves: "
                     "scripts/megatron_expert_bias_capacity_repro.py")
    description = ("Megatron-Core 0.16 GPTModel with MoELayer and the routers' balancing bias "
                   "(capacity mode)")

