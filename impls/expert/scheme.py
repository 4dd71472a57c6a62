"""``expert.alltoall``: data parallelism over dp ranks with the experts of every MoE layer
sharded over ep of them (GShard, Lepikhin et al. 2020, Sec. 3.2; Switch Transformer, Fedus et
al. 2021, Sec. 2.2; the Megatron-Core layout, ``parbench.mesh``: ep groups of consecutive
ranks, edp = dp/ep replicas of each expert shard).

Each rank holds the reference model's dense parameters (the router included) and E/ep experts
of every MoE layer (``layer.localize``), trains on its ``dp_slice`` of the global batch in m
micro-batches, and routes each micro-batch's b s tokens, position-major, as one routing
group: **capacity is per rank** (C = ceil(cf k b s / E), Switch Eq. 3, never computed from the
global token count), and so are the dropping order and the auxiliary losses, exactly as the
golden run is told to route (``Scheme.routing_groups``: one group per rank and micro-batch).
Each micro-batch's loss is its token mean / m and each layer's auxiliary term is scaled by
1/m, so that the sum over the ranks' micro-batches is the mean over all dp m groups
(``parbench.model.moe``). With ``loss_mask`` the token mean is over the micro-batch's
counted tokens n_mb and is scaled by n_mb d / N instead (N: the global batch's counted
tokens; ``loss_scale``), so that after the 1/d of the reductions the cross-entropy is the
global mean over counted tokens (Megatron-LM's ``--calculate-per-token-loss``; every rank
holds the global batch, so N needs no all-reduce); the auxiliary terms, which count every
routed token, keep their 1/m.

**Gradients.** The global loss is L = (1/d) sum_r L_r (d = dp ranks, L_r rank r's loss; every
rank holds as many tokens). A dense parameter's gradient is (1/d) sum_r dL_r: one flat
all-reduce over dp, divided by d. An expert e lives on one rank of each ep group; its tokens
come only from that ep group, and the reverse all-to-all brings it the output gradients of
every peer, so after backward its gradient on that rank is sum over the ep group's ranks r of
dL_r/dW_e. The edp replicas of e (one per ep group) hold the sums over disjoint ep groups that
together cover all d ranks, so **summing over edp** gives sum_r dL_r/dW_e and **dividing by d**
(not by edp) gives the gradient of L. Averaging over edp instead would scale the experts'
gradients by ep (DeepSpeed divides by the dense dp size for the same reason,
``engine._reduce_expert_gradients``). Then one AdamW step on everything the rank holds.

**Clipping** (``clip_grad``): by the global norm, the dense squares counted here and the
experts' summed over ep (``impls.expert.clip``), after the reductions; the clipped gradients
are the ones stepped on and reported.

**DeepSeek-V3's MoE** (arXiv 2412.19437, Sec. 2.1.2; ``parbench.model.router``): the shared
expert is a dense parameter (replicated on every rank, averaged over dp with the rest); the
sigmoid router and group-limited routing are the reference router's; the balancing bias is
updated after the optimizer step from the step's global load -- each rank's per-expert
assignments of every micro-batch, summed over dp in one all-reduce of ``[L_moe, E]`` float32
(``update_bias``) -- so it is the same on every rank and equals the golden model's
(``full_state``).

``full_params`` / ``full_grads`` gather the other ep ranks' experts for the verdict, outside
the ledger (``comm.unrecorded``). Closed forms: ``parbench.analytic.expert``.
"""
from __future__ import annotations

from typing import ClassVar

import torch
import torch.distributed as dist

from parbench import comm
from parbench.analytic import expert as closed
from parbench.batching import dp_slice, microbatches
from parbench.config import CaseConfig, ConfigError
from parbench.model import (build_model, clip_coefficient, counted_tokens, make_optimizer,
                            scale_grads_)
from parbench.model.moe import set_aux_scale
from parbench.model.router import bias_of, expert_bias_state, updated_bias
from parbench.moe_rules import DEEPSEEK_MOE_FIELDS, MOE_FEATURES
from parbench.probes import microbatch_rows, reference_probes
from parbench.scheme import Prediction, Scheme, register

from impls.data.buckets import Bucket

from .clip import expert_parallel_norm
from .dispatch import ExpertDispatch
from .layer import is_expert_param, localize, moe_layers
from .stats import StepStats, row_metrics

#: the MoE fields the scheme reads (``Scheme.options``)
MOE_OPTIONS = ("num_experts", "moe_top_k", "moe_every", "moe_capacity_factor",
               "moe_aux_loss_coef", "moe_z_loss_coef", "moe_router_skew", *DEEPSEEK_MOE_FIELDS)


@register
class ExpertAllToAll(Scheme):
    name = "expert.alltoall"
    family = "expert"
    uses = ("ep", "dp")
    supports_moe = True
    supports_clip_grad = True
    #: a masked loss normalised by the global count (``loss_scale``)
    supports_loss_mask = True
    #: the dense parts are the reference model's, which finds each sample's packed documents
    #: in its tokens and runs RoPE, GQA, RMSNorm, SwiGLU, no biases and multi-head latent
    #: attention (DeepSeek-V3's ``deepseek-v3-tiny``; replicated, averaged over dp with the
    #: rest of the dense parameters); the experts are the dense MLP's kind
    #: (``moe.expert_mlp``: Mixtral's SwiGLU experts without biases, MoE feature
    #: llama-experts)
    supports_packing = True
    model_features: ClassVar[frozenset] = frozenset({"rope", "gqa", "rmsnorm", "swiglu",
                                                     "no-bias", "mla"})
    #: what a framework's MoE baseline runs of them (its own GELU experts with biases)
    BASELINE_FEATURES: ClassVar[frozenset] = frozenset({"rope", "gqa", "rmsnorm"})
    #: DeepSeek-V3's MoE (``parbench.moe_rules``): the shared expert is dense (over dp), the
    #: balancing bias updated from the step's load all-reduced over dp (``update_bias``)
    moe_features: ClassVar[frozenset] = MOE_FEATURES
    options: ClassVar[tuple[str, ...]] = MOE_OPTIONS
    description = ("expert parallelism (GShard / Switch): experts sharded over ep, two "
                   "all-to-alls per MoE layer each way, dense grads over dp, experts over edp")
    #: the MoE layer's steps (a variant replaces one: the self-test's mutants)
    dispatch_class: ClassVar[type] = ExpertDispatch
    #: which parameters are sharded over ep (the rest, the shared expert included, is dense)
    expert_param = staticmethod(is_expert_param)
    #: experts whole on their rank (expert-tp 1); a framework baseline that splits them over
    #: tp as Megatron-Core's default (expert-tp = tp) says so
    experts_split_over_tp: ClassVar[bool] = False

    @classmethod
    def check(cls, case: CaseConfig) -> None:
        super().check(case)
        m, p = case.model, case.layout
        if not m.num_experts:
            raise ConfigError(f"num_experts=0: {cls.name} needs an MoE model "
                              "(set num_experts > 0)")
        if cls.experts_split_over_tp and p.expert_tp != p.tp:
            raise ConfigError(f"etp={p.etp}: {cls.name} splits the experts over tp "
                              f"(expert-tp = tp = {p.tp}); set etp=0")
        if not cls.experts_split_over_tp and p.expert_tp != 1:
            raise ConfigError(f"etp={p.etp} is not used by {cls.name} (experts are whole on "
                              "their rank); set etp=0 or 1")
        if case.run.dtype != "fp32":
            raise ConfigError(f"dtype={case.run.dtype!r} is not supported by {cls.name} "
                              "(fp32 only)")
        if m.moe_router_skew and cls.baseline_of:
            raise ConfigError(f"moe_router_skew={m.moe_router_skew}: {cls.name} routes with "
                              "its library's own gate, which has no skew; set moe_router_skew=0")
        # a baseline inherits this class's clipping only by declaring it itself
        if case.run.clip_grad and cls.baseline_of and not vars(cls).get("supports_clip_grad"):
            raise ConfigError(f"clip_grad={case.run.clip_grad:g}: baseline {cls.name} does "
                              "not clip with its framework's own clipping; set clip_grad=0")
        used = case.model.moe_features()
        # a baseline (or a mutant of one) runs the features its own class declares
        if used and cls.baseline_of and cls.moe_features is ExpertAllToAll.moe_features:
            raise ConfigError(f"{next(iter(used.values()))}: baseline {cls.name} routes with "
                              "its framework's own MoE layer, which parbench does not set up "
                              "with DeepSeek-style experts or routing (run expert.alltoall)")
        if case.run.loss_mask and cls.baseline_of and not vars(cls).get("supports_loss_mask"):
            raise ConfigError(f"loss_mask={case.run.loss_mask:g}: baseline {cls.name} does "
                              "not normalise a masked loss by the global token count "
                              "(set loss_mask=0)")

    def __init__(self, ctx):
        super().__init__(ctx)
        mesh = ctx.mesh
        self.dp, self.dp_rank = mesh.size("dp"), mesh.index("dp")
        self.ep, self.ep_rank = mesh.size("ep"), mesh.index("ep")
        self.edp = mesh.size("edp")
        self.dispatch = self.make_dispatch()
        self.model = self.build_local_model().to(ctx.device)
        named = self.named_parameters()
        self.dense = Bucket([p for n, p in named if not self.expert_param(n)], torch.float32,
                            ctx.device)
        self.experts = Bucket([p for n, p in named if self.expert_param(n)], torch.float32,
                              ctx.device)
        self.opt = make_optimizer([p for _, p in named], ctx.run)
        self.layers = moe_layers(self.model)
        self.step_stats = StepStats()

    def make_dispatch(self) -> ExpertDispatch:
        return self.dispatch_class(self.ctx.model, self.ctx.mesh.group("ep"), self.ep)

    def build_local_model(self) -> torch.nn.Module:
        """The reference model with this rank's shard of every MoE layer."""
        return localize(build_model(self.ctx.model, self.ctx.run.seed), self.ep_rank, self.ep,
                        self.dispatch)

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """The rank's parameters under the reference model's (global) names."""
        return list(self.model.named_parameters())

    # ---- the step -----------------------------------------------------------------------------
    def aux_scale(self, m: int) -> float:
        """Each of the m groups a rank routes per layer and step carries 1/m of its auxiliary
        term (with the 1/d of the dense all-reduce: the mean over all d m groups)."""
        return 1.0 / m

    def set_aux_scale(self, m: int) -> None:
        set_aux_scale(self.model, self.aux_scale(m))

    def local_microbatches(self, inputs, targets):
        """This rank's micro-batches of its dp slice; notes the global batch's counted
        tokens for ``loss_scale``."""
        self.global_tokens = counted_tokens(targets)
        dev = self.ctx.device
        x = dp_slice(inputs, self.dp_rank, self.dp).to(dev)
        y = dp_slice(targets, self.dp_rank, self.dp).to(dev)
        return microbatches(x, y, self.ctx.layout.num_microbatches)

    def loss_scale(self, ym: torch.Tensor) -> float:
        """What a micro-batch's mean token loss is multiplied by: 1/m when every token
        counts; with ``loss_mask``, n_mb d / N (Megatron-LM's --calculate-per-token-loss;
        module docstring)."""
        if not self.ctx.run.loss_mask:
            return 1.0 / self.ctx.layout.num_microbatches
        return counted_tokens(ym) * self.dp / self.global_tokens

    def train_step(self, inputs, targets, step):
        mbs = self.local_microbatches(inputs, targets)
        m = len(mbs)
        tl = self.ctx.timeline
        self.dense.reset()
        self.experts.reset()
        self.set_aux_scale(m)
        total = 0.0
        for i, (xm, ym) in enumerate(mbs):
            with tl.span("F", mb=i):
                loss = self.model(xm, ym) * self.loss_scale(ym)
            with tl.span("B", mb=i):
                loss.backward()
            total += float(loss.detach())
        with tl.span("grad_allreduce"):
            self.reduce_dense_gradients()
            self.reduce_expert_gradients()
        with tl.span("optim"):
            self.clip()
            self.opt.step()
        per_layer = [lay.take_stats() for lay in self.layers]
        self.update_bias(per_layer)
        self.step_stats.record(step, per_layer, comm.active())
        return self.reduce_loss(total / self.dp, self.ctx.mesh.group("dp"))

    # ---- the balancing bias (DeepSeek-V3 Sec. 2.1.2) ----------------------------------------
    def global_load(self, local: torch.Tensor) -> torch.Tensor:
        """The step's load ``[L_moe, E]`` over every rank that routes tokens: this rank's
        summed over dp (one all-reduce of L_moe E float32; every dp rank routes its own
        tokens), as Megatron-Core sums ``tokens_per_expert`` before updating the bias."""
        if self.dp > 1:
            dist.all_reduce(local, group=self.ctx.mesh.group("dp"))
        return local

    def update_bias(self, per_layer: list[list[dict]]) -> None:
        """b += gamma sign(mean load - load) per MoE layer with the step's global load (every
        micro-batch, every rank, before dropping): the same bias on every rank."""
        rate = self.ctx.model.moe_bias_update_rate
        if not rate:
            return
        local = torch.tensor([[sum(v) for v in zip(*[s["load"] for s in stats])]
                              for stats in per_layer], dtype=torch.float32,
                             device=self.ctx.device)
        with self.ctx.timeline.span("bias_update"):
            load = self.global_load(local)
            with torch.no_grad():
                for lay, row in zip(self.layers, load):
                    bias = bias_of(lay.router)
                    bias.copy_(updated_bias(bias, row, rate))

    def reduce_dense_gradients(self) -> None:
        """Mean over the dp ranks: one flat all-reduce, / d."""
        if self.dp > 1:
            dist.all_reduce(self.dense.buffer, group=self.ctx.mesh.group("dp"))
        self.dense.buffer.div_(self.dp)

    def reduce_expert_gradients(self) -> None:
        """Sum over the edp replicas, / d (module docstring: the global mean)."""
        if self.edp > 1:
            dist.all_reduce(self.experts.buffer, group=self.ctx.mesh.group("edp"))
        self.experts.buffer.div_(self.dp)

    def grad_norm(self) -> float:
        """The global gradient norm after the reductions: dense squares here, the experts'
        summed over ep (``impls.expert.clip``)."""
        return expert_parallel_norm([self.dense.buffer], [self.experts.buffer],
                                    self.ctx.mesh.group("ep"))

    def clip(self) -> None:
        """Clip every gradient the rank steps on by the global norm (``clip_grad`` 0: no
        norm, no collective)."""
        clip = self.ctx.run.clip_grad
        if clip:
            coef = clip_coefficient(self.grad_norm(), clip)
            scale_grads_([self.dense.buffer, self.experts.buffer], coef)

    # ---- what the verdict compares ------------------------------------------------------------
    def _gathered(self, mine: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``mine`` plus the other ep ranks' experts (outside the ledger)."""
        if self.ep == 1:
            return mine
        parts: list = [None] * self.ep
        with comm.unrecorded():
            dist.all_gather_object(parts, {n: t.detach().cpu() for n, t in mine.items()
                                           if is_expert_param(n)},
                                   group=self.ctx.mesh.group("ep"))
        out = dict(mine)
        for part in parts:
            for n, t in part.items():
                out.setdefault(n, t.to(self.ctx.device))
        return out

    def module_probes(self):
        """The rank's modules as probes (issue 20, sec. 5), as the data family's: each
        micro-batch's call computes its rows of the rank's dp slice, the MoE layers included
        (their output for those rows, after the combine); loss / m per micro-batch on 1/d of
        the batch, so input gradients are d times the golden's. None for the framework
        baselines, whose modules are the framework's."""
        if self.baseline_of:
            return None
        rows = self.ctx.layout.global_batch_size // self.dp
        calls = microbatch_rows(self.dp_rank * rows, rows, self.ctx.layout.num_microbatches)
        return reference_probes(self.model, calls, grad_scale=1.0 / self.dp)

    def full_params(self):
        return self._gathered({n: p.detach() for n, p in self.named_parameters()})

    def full_grads(self):
        return self._gathered({n: p.grad.detach() for n, p in self.named_parameters()})

    def full_state(self):
        """The routers' balancing biases: replicated, each rank's own copy (none without
        the bias: the framework baselines hold no reference model)."""
        if not self.ctx.model.moe_bias_update_rate:
            return {}
        return {n: b.detach() for n, b in expert_bias_state(self.model).items()}

    # ---- closed forms and measurements ----------------------------------------------------------
    @classmethod
    def predict(cls, case: CaseConfig) -> Prediction:
        p = case.layout
        pred = closed.expert_prediction(case.model, ep=p.ep, dp=p.dp,
                                        micro_batch_size=p.micro_batch_size,
                                        num_microbatches=p.num_microbatches,
                                        optimizer=case.run.optimizer,
                                        clip_grad=case.run.clip_grad)
        return Prediction.uniform(p.world_size, pred.wire_bytes, pred.states, pred.calls,
                                  **pred.figures)

    def metrics(self) -> dict:
        return row_metrics(self.step_stats, self.ctx, self.predict(self.ctx.case).figures)
