"""``hybrid``: data, tensor (optionally sequence), context, expert and pipeline parallelism at
once on the Megatron-Core mesh (Narayanan et al. 2021's PTD-P, with cp and ep).

A rank holds, for each pipeline stage its schedule places on it, a ``model.HybridStage``:
the tp shards of the stage's layers, its cp tokens, its E/ep experts of each MoE layer. The
pipeline executor of ``impls.pipeline`` runs the schedule on the pp group with boundary
tensors ``[s/cp (/t under SP), b, h]``: any synchronous schedule of the pipeline family --
GPipe, 1F1B, interleaved 1F1B, looped BFS, the split-backward ZB-H1, ZB-H2 and ZB-V (the
tensor-parallel linears do only B's or W's part, ``impls.common.backward_pass``), and the
bidirectional Chimera, DualPipe and DualPipeV (two stage copies per rank; their gradients are
added with the partner rank's first, ``impls.pipeline.replicas``). PipeDream and 2BW are
refused: they update weights asynchronously and are checked against their own update rule,
which a once-per-step optimizer does not follow. After the schedule, once per step:

1. the gradients partial over tp (routers; under SP the tp-replicated parameters) are summed
   over tp in one buffer;
2. the dense gradients are averaged over the dp x cp ranks (``dp_cp``, one flat
   all-reduce); every rank's loss is the mean over its own b s/cp tokens, and the dp x cp
   ranks hold disjoint, equal token sets, so the average is the global mean gradient;
3. the expert gradients are summed over the expert-data-parallel group (``edp``) and divided
   by dp cp: an expert's holder already has the contributions of every token its ep group
   dispatched to it, the edp replicas cover the rest, and each token's loss term carries
   its rank's 1/(tokens) of a loss that must be averaged over the dp cp token sets;
4. with ``clip_grad``, every gradient scaled by the factor of the global norm, counted once
   over tp, dp x cp / edp shards, ep and pp (``impls.hybrid.clip``);
5. one AdamW step over the rank's tensors -- or, with ``zero_stage`` 1-3, the reductions of
   2 and 3 are reduce-scatters of one padded flat buffer per group and AdamW steps the
   rank's shard, all-gathered back (``optimizer.GradientGroup``: Megatron's distributed
   optimizer, ZeRO-2, FSDP as torchtitan runs it under a pipeline). With ``dtype=bf16`` the
   parameters, activations and gradients are bf16 and AdamW steps fp32 masters.

MoE routing groups: a rank routes one group per micro-batch (its b samples x its tp block of
its cp positions), so the auxiliary terms are scaled by 1/(m t) (summed over tp, averaged
over dp cp: the mean over all groups), and ``routing_groups`` tells the golden run the same
cut. DeepSeek-V3's MoE blocks (``deepseek-tiny``): the shared expert is dense (``model``),
the balancing biases are updated after step 5 from the stage's loads (``balance``).

The training features of the other families, on every axis at once:

- ``loss_mask`` (Megatron-LM's --calculate-per-token-loss): a last stage sums its counted
  tokens' losses and the executor scales the sum by dp cp / N, N the global batch's counted
  tokens (``executor``); steps 2 and 3 then give the global per-token mean's gradient;
- ``pack_docs``: every stage gets the micro-batch's documents from the executor, found in the
  whole samples' tokens (``model``); with cp > 1 only a core that masks them
  (``model.core_packs``: all-gather CP) -- the others are refused before spawning;
- ``tie_embeddings`` with a pipeline: the first stage's embedding shard and the last stage's
  copy of it as the output layer add their gradients over the embedding group before step 2
  (``impls.pipeline.tied``, Megatron-LM's ``_allreduce_word_embedding_grads``): per tp rank
  its V'/t rows, one all-reduce on axis ``embd``; both copies report the tied weight's name,
  and the copy is left out of the clipping norm (Megatron's shared-embedding filter).
"""
from __future__ import annotations

import torch

from parbench import comm
from parbench.analytic import hybrid as closed
from parbench.analytic.shape import shape_from
from parbench.batching import dp_slice, microbatches
from parbench.config import MODEL_FEATURES, CaseConfig, ConfigError
from parbench.model import compute_dtype, counted_tokens, make_optimizer, stage_layers
from parbench.model.moe import RoutingGroups
from parbench.moe_rules import DEEPSEEK_MOE_FIELDS, MOE_FEATURES
from parbench.scheme import Prediction, Scheme, register
from parbench.schedules import get_spec

from impls.context.layout import positions
from impls.context.ring import AttentionClock
from impls.pipeline import replicas
from impls.pipeline.scheme import schedule_for
from impls.pipeline.tied import EMBD_AXIS, TiedEmbeddings, reported_name
from impls.pipeline.weights import StageSlot, SyncWeights
from impls.tensor.collectives import all_reduce_flat
from impls.tensor.shards import gather_full

from .balance import check_bias, global_load, update_biases
from .clip import clip_hybrid_, counted_params, hybrid_norm, norm_axes
from .executor import HybridExecutor
from .figures import ubmesh_table
from .model import CP_KINDS, HybridStage, build_core, core_packs
from .optimizer import GradientGroup


class _Accumulate(SyncWeights):
    """One weight version, gradients accumulated over the micro-batches; the scheme reduces
    them and steps the optimizer itself."""

    def make_optimizer(self, params):
        return None

    def step_end(self) -> None:
        pass


@register
class HybridScheme(Scheme):
    name = "hybrid"
    family = "hybrid"
    description = "PTD-P with cp and ep: Megatron TP(+SP) x CP x EP x DP x pipeline schedule"
    uses = ("tp", "cp", "ep", "dp", "pp")
    supports_moe = True
    supports_clip_grad = True
    #: the summed counted-token losses scaled by dp cp / N (``executor``)
    supports_loss_mask = True
    #: documents handed to every stage; cp > 1 only with a core that masks them (``check``)
    supports_packing = True
    #: the stage model, the pipeline executor, the gradient groups' synchronisation and
    #: their mesh axes (dense, experts); the self-test's mutants swap in broken ones
    stage_class = HybridStage
    executor_class = HybridExecutor
    group_class = GradientGroup
    gradient_axes = ("dp_cp", "edp")
    options = ("sp", "vpp", "schedule", "recompute", "cp_balance", "cp_algorithm", "etp",
               "zero_stage", "num_experts", "moe_top_k", "moe_every", "moe_capacity_factor",
               "moe_aux_loss_coef", "moe_z_loss_coef", *DEEPSEEK_MOE_FIELDS)
    #: DeepSeek-V3's MoE (``parbench.moe_rules``): the MoE layers route with the reference
    #: router's rule (``impls.expert.dispatch``), the shared expert whole and dense
    #: (``model``), the balancing bias from the stage's loads over tp x dp x cp (``balance``)
    moe_features = MOE_FEATURES
    #: the step's loads summed over the routing ranks (a mutant keeps the local ones)
    global_load = staticmethod(global_load)
    #: the LLaMA blocks of the Megatron stage (``impls.tensor.megatron_model``), RoPE at the
    #: rank's global (or within-document) positions and K/V at their own heads in the cp
    #: cores (``model.HybridStage.cp_heads``); multi-head latent attention is the stage's
    #: (``impls.tensor.megatron_mla``: down projections whole, up projections over tp), at
    #: cp = 1 (the config refuses MLA under cp) and not under selective recomputation
    model_features = MODEL_FEATURES | {"mla"}

    # ---- checks ---------------------------------------------------------------------------------
    @classmethod
    def check(cls, case: CaseConfig) -> None:
        super().check(case)
        p, m, r, o = case.layout, case.model, case.run, case.options
        if r.optimizer != "adamw":
            raise ConfigError(f"optimizer={r.optimizer!r}: hybrid steps AdamW (its closed "
                              "form counts AdamW's states)")
        kind = o.context.cp_algorithm
        if kind not in CP_KINDS:
            raise ConfigError(f"cp_algorithm={kind!r}: hybrid runs one of {', '.join(CP_KINDS)}")
        if m.num_experts and p.tp > 1 and p.expert_tp != 1:  # ep = 1 too (etp 0 = tp)
            raise ConfigError(f"etp={p.etp} (= tp when 0): hybrid keeps experts whole and "
                              "splits their tokens over tp; set etp=1")
        if m.kv_lora_rank and o.recompute == "selective":
            raise ConfigError(f"recompute=selective with kv_lora_rank={m.kv_lora_rank}: "
                              "hybrid recomputes no MLA core (use none or full)")
        if m.pack_docs and p.cp > 1 and not core_packs(kind):
            raise ConfigError(f"pack_docs={m.pack_docs}: hybrid's cp_algorithm={kind!r} core "
                              f"does not mask packed documents, needed with cp={p.cp} > 1 "
                              "(use cp_algorithm='allgather', or cp=1)")
        s_l = m.seq_length // p.cp
        if p.tp > 1 and (o.tensor.sp or m.num_experts) and s_l % p.tp:
            raise ConfigError(f"tp={p.tp} must divide seq_length/cp={s_l} (sequence "
                              "parallelism and the MoE token split cut the rank's tokens)")
        if p.cp > 1 and cls.balance(case) == "zigzag" and m.seq_length % (2 * p.cp):
            raise ConfigError(f"cp_balance='zigzag' needs 2*cp={2 * p.cp} to divide "
                              f"seq_length={m.seq_length}")
        if kind == "ulysses" and (m.num_heads // p.tp) % p.cp:
            raise ConfigError(f"cp={p.cp} must divide num_heads/tp={m.num_heads // p.tp} "
                              "(Ulysses shards the rank's heads)")
        kv = m.num_kv_heads or m.num_heads
        if kind == "ulysses" and p.cp > 1 and (kv // p.tp) % p.cp:
            raise ConfigError(f"cp={p.cp} must divide num_kv_heads/tp={kv // p.tp} "
                              "(Ulysses shards the rank's K/V heads)")
        if get_spec(p.schedule).asynchronous:
            raise ConfigError(f"schedule={p.schedule!r} updates weights asynchronously "
                              "(weight stashing, checked against its own update rule); "
                              "hybrid steps once per step: use a synchronous schedule")
        check_bias(case, get_spec(p.schedule).placement)
        schedule_for(case, p.schedule)

    @classmethod
    def balance(cls, case) -> str:
        ctx_opts = case.options.context
        return "none" if ctx_opts.cp_algorithm == "ulysses" else ctx_opts.cp_balance

    @classmethod
    def cp_positions(cls, case: CaseConfig, cp_rank: int) -> torch.Tensor:
        p = case.layout
        return positions(case.model.seq_length, p.cp, cp_rank, cls.balance(case))

    @classmethod
    def routing_groups(cls, case: CaseConfig) -> RoutingGroups:
        """A group per micro-batch of a rank: its cp rank's positions, cut into t blocks."""
        p, s = case.layout, case.model.seq_length
        chunks = [0] * s
        for c in range(p.cp):
            pos = cls.cp_positions(case, c).tolist()
            n = len(pos) // p.tp
            for j, x in enumerate(pos):
                chunks[x] = c * p.tp + j // n
        return RoutingGroups(rows=p.micro_batch_size, chunks=tuple(chunks))

    # ---- construction -------------------------------------------------------------------------
    def __init__(self, ctx):
        super().__init__(ctx)
        mesh, cfg, par = ctx.mesh, ctx.model, ctx.layout
        self.tp, self.cp, self.dp = mesh.size("tp"), mesh.size("cp"), mesh.size("dp")
        self.cp_rank, self.dp_rank = mesh.index("cp"), mesh.index("dp")
        self.m = par.num_microbatches
        self.pos = tuple(self.cp_positions(ctx.case, self.cp_rank).tolist())
        self.clock = AttentionClock(ctx.timeline)
        self.dtype = compute_dtype(ctx.run)
        core = None
        if self.cp > 1:
            every = [self.cp_positions(ctx.case, c) for c in range(self.cp)]
            core = build_core(ctx.options.context.cp_algorithm, mesh.group("cp"), self.cp,
                              every, self.clock, self.balance(ctx.case))
        self.schedule = schedule_for(ctx.case, par.schedule)
        S = self.schedule.num_stages  # noqa: N806
        pp_rank = mesh.index("pp")
        self.slots = {}
        for key in self.schedule.stages_of(pp_rank):
            lo, hi = stage_layers(cfg.num_layers, S, key[1])
            stage = self.stage_class(
                cfg, ctx.run.seed, tp_group=mesh.group("tp"), tp=self.tp,
                tp_rank=mesh.index("tp"), sp=ctx.options.tensor.sp,
                recompute=ctx.options.recompute,
                stage=(lo, hi, key[1] == 0, key[1] == S - 1),
                positions=torch.tensor(self.pos), core=core,
                ep_group=mesh.group("ep") if par.ep > 1 else None, ep=par.ep,
                ep_rank=mesh.index("ep") if par.ep > 1 else 0,
                aux_scale=1.0 / (self.m * self.tp),
                summed_loss=bool(ctx.run.loss_mask)).to(ctx.device)
            self.slots[key] = StageSlot(key[0], key[1], stage)
        stages = [s.module for s in self.slots.values()]
        self.partial = [p for st in stages for p in st.tp_partial_params()]
        self.dense = [p for st in stages for p in st.dense_params()]
        self.experts = [p for st in stages for p in st.expert_params()]
        #: the tied word embedding's copies on this rank (collective: the embedding groups)
        self.tied = TiedEmbeddings(list(self.slots.values()), self.schedule, pp_rank, mesh) \
            if cfg.tie_embeddings and S > 1 else None
        self.weights = _Accumulate(list(self.slots.values()), ctx.run)
        dense_axis, expert_axis = self.gradient_axes
        self.groups = [
            self.group_class(params, mesh.group(axis) if mesh.size(axis) > 1 else None,
                             mesh.size(axis), mesh.index(axis), divisor,
                             ctx.options.data.zero_stage, self.dtype)
            for params, axis, divisor in ((self.dense, dense_axis, self.dp * self.cp),
                                          (self.experts, expert_axis, self.expert_divisor()))]
        self.opt = make_optimizer([t for g in self.groups for t in g.masters], ctx.run)
        n = par.micro_batch_size
        act = (cfg.seq_length // self.cp // (self.tp if stages[0].sp else 1), n,
               cfg.hidden_size)
        self.peer = None  # the partner rank of a bidirectional schedule's two copies
        if len(self.schedule.pipes) > 1:
            self.peer = mesh.ranks("pp")[self.schedule.p - 1 - pp_rank]
        self.executor = self.make_executor(act, pp_rank)

    def make_executor(self, act_shape: tuple, pp_rank: int) -> HybridExecutor:
        """The schedule's executor on the pp group (boundary tensors ``act_shape``)."""
        mesh, ctx = self.ctx.mesh, self.ctx
        return self.executor_class(
            schedule=self.schedule, pp_rank=pp_rank, group=mesh.group("pp"),
            group_ranks=mesh.ranks("pp"), slots=self.slots, act_shape=act_shape,
            dtype=self.dtype, device=ctx.device, timeline=ctx.timeline, weights=self.weights,
            m=self.m, token_sets=self.dp * self.cp)

    # ---- the step -----------------------------------------------------------------------------
    def train_step(self, inputs, targets, step):
        mesh, dev, tl = self.ctx.mesh, self.ctx.device, self.ctx.timeline
        # whole samples: each stage takes its cp columns (``model.HybridStage.forward``)
        x = dp_slice(inputs, self.dp_rank, self.dp).to(dev)
        y = dp_slice(targets, self.dp_rank, self.dp).to(dev)
        mbs = microbatches(x, y, self.m)
        for g in self.groups:
            g.begin()
        self.weights.step_begin()
        if self.ctx.run.loss_mask:  # N: the global batch's counted tokens
            self.executor.global_tokens = counted_tokens(targets)
        out = self.executor.run([a for a, _ in mbs], [b for _, b in mbs], step,
                                track=False)
        if self.peer is not None:
            with tl.span("sync"):
                self.sync_replicas()
        if self.tied is not None:
            with tl.span(EMBD_AXIS):
                self.sync_tied()
        with tl.span("reduce"):
            if self.partial:
                all_reduce_flat([p.grad for p in self.partial], mesh.group("tp"))
            for g in self.groups:
                g.reduce()
        with tl.span("optim"):
            self.clip()
            self.opt.step()
            for g in self.groups:
                g.finish()
        with tl.span("bias_update"):
            update_biases([s.module.balance for s in self.slots.values()], mesh,
                          self.global_load)
        last = any(s.module.last for s in self.slots.values())
        total = self.reduce_loss(out.loss if last else 0.0)
        return total / (self.tp * self.dp * self.cp)

    def clip_counted(self) -> set[int]:
        """Ids of the parameters whose squares this rank adds: no tp duplicate, no second
        stage copy, no output-layer copy of a tied embedding (``impls.hybrid.clip``)."""
        heads = {id(w) for w in self.tied.heads} if self.tied is not None else set()
        return counted_params(self.slots, self.ctx.mesh.index("tp"),
                              self.peer is not None) - heads

    def clip_axes(self) -> tuple[list[str], list[str]]:
        """The axes the dense and the expert squares are summed over (then pp)."""
        return norm_axes(self)

    def grad_norm(self) -> float:
        """The global norm of the reduced gradients (``impls.hybrid.clip``)."""
        return hybrid_norm(self, self.clip_counted(), *self.clip_axes())

    def clip(self) -> None:
        """Clip by global norm (``clip_grad`` 0: nothing, no collective)."""
        if self.ctx.run.clip_grad:
            clip_hybrid_(self, self.grad_norm())

    def sync_replicas(self) -> None:
        """A bidirectional schedule's two stage copies: add the partner rank's gradients."""
        replicas.sync_gradients(self.slots, self.ctx.mesh.group("pp"), self.peer)

    def sync_tied(self) -> None:
        """The tied embedding's first- and last-stage copies (this rank's tp shards): add
        their gradients over the embedding group (``impls.pipeline.tied``), before the
        reductions over dp x cp."""
        self.tied.sync_gradients()

    def expert_divisor(self) -> int:
        """Expert gradients are summed over edp and divided by dp cp (module docstring,
        step 3)."""
        return self.dp * self.cp

    # ---- the verdict's view -------------------------------------------------------------------
    def _full(self, grads: bool) -> dict[str, torch.Tensor]:
        mesh = self.ctx.mesh
        out: dict[str, torch.Tensor] = {}
        with comm.unrecorded():
            for g in self.groups:
                g.materialize()
            values = {k: v for g in self.groups for k, v in g.full(grads).items()}
            slots = list(self.slots.values()) if self.peer is None else \
                replicas.reported(self.slots, mesh.group("pp"), self.peer, check=not grads)
            tied = self.tied is not None
            for slot in slots:
                named = {name: (values[id(local)], pl)
                         for name, (local, pl) in slot.module.shards().items()}
                full = gather_full(named, mesh.group("tp"), mesh.ranks("tp"), mesh.index("tp"))
                out.update({reported_name(n, tied): t for n, t in full.items()})
        return out

    def full_params(self):
        return self._full(grads=False)

    def full_state(self):
        """The balancing biases of the rank's MoE layers (``balance``; none without)."""
        return {n: b for s in self.slots.values() for n, b in s.module.balance.state().items()}

    def full_grads(self):
        return self._full(grads=True)

    def metrics(self) -> dict:
        """Routing of the last step, summed over this rank's MoE layers (last micro-batch):
        assignments per expert, dropped per expert, max/mean load, mean aux and z-loss."""
        stats = [st for s in self.slots.values() for st in s.module.moe_stats.values()]
        if not stats:
            return {}
        load = [sum(v) for v in zip(*(st["load"] for st in stats))]
        dropped = [sum(v) for v in zip(*(st["dropped"] for st in stats))]
        return {"moe_load_per_expert": load, "moe_dropped_per_expert": dropped,
                "moe_load_imbalance": max(load) / max(sum(load) / len(load), 1e-9),
                "moe_aux_loss": sum(st["aux_loss"] for st in stats) / len(stats),
                "moe_z_loss": sum(st["z_loss"] for st in stats) / len(stats)}

    @classmethod
    def figures(cls, case: CaseConfig, per_rank: list, out_dir):
        """UB-Mesh Table 1 for this case (``figures.ubmesh_table``)."""
        return ubmesh_table(case, per_rank, out_dir,
                            closed.rank_step(shape_from(case.model), cls.hybrid_config(case),
                                             0)[0])

    # ---- closed form --------------------------------------------------------------------------
    @classmethod
    def hybrid_config(cls, case: CaseConfig) -> closed.HybridStep:
        spec = get_spec(case.layout.schedule)
        return closed.HybridStep(layout=case.layout, options=case.options,
                                 placement=str(spec.placement),
                                 chunks=spec.chunks_for(case.layout.vpp),
                                 e=2 if case.run.dtype == "bf16" else 4,
                                 clip_grad=case.run.clip_grad)

    @classmethod
    def predict(cls, case: CaseConfig) -> Prediction:
        p, c, shape = case.layout, cls.hybrid_config(case), shape_from(case.model)
        wire, calls, states = [], [], []
        for r in range(p.world_size):
            tr, st = closed.rank_step(shape, c, r)
            w, n = closed.per_axis(tr)
            wire.append(w)
            calls.append(n)
            states.append(st)
        return Prediction(wire_bytes=wire, calls=calls, model_state_bytes=states)
