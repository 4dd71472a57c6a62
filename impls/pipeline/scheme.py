"""Pipeline parallelism: every schedule of ``parbench.schedules`` run by one executor.

Schemes ``pipeline.<name>`` for gpipe, 1f1b, interleaved, zb-h1, zb-h2, zbv, chimera,
dualpipe, dualpipev, bfs, pipedream, 2bw, hanayo, vhalf and vmin (and every other registered
schedule). The model is cut into S consecutive stages (``parbench.model.build_stage``; S = p
for one-stage-per-rank and bidirectional schedules, p*v for interleaved / looped BFS and
Hanayo's waves, 2p for the V shapes); a rank holds the stages the
schedule's placement gives it (two model replicas for Chimera and DualPipe).

Synchronous schedules equal the golden run: each micro-batch loss is scaled by 1/m, so the
gradients accumulated over the m micro-batches are the full-batch mean gradient; one AdamW
step follows. Chimera and DualPipe hold each stage twice (pipe 0 on rank s, pipe 1 on rank
p-1-s, Li & Hoefler 2021 Sec. 3; DeepSeek-V3 report Sec. 3.2.1): after the schedule, the two
ranks holding a stage add their gradients -- an all-reduce on two ranks, done as one
exchange of each rank's flat gradients over the pp group (S bytes sent per rank =
2(n-1)/n * S at n = 2, the ring all-reduce volume) and summed in the same order on both
ranks, so the replicas stay bit-identical. PipeDream and PipeDream-2BW follow their own
delayed-update rules and are checked against a single-device run of the same rule
(``asynchronous``), running without a flush between steps. With ``tie_embeddings`` the
synchronous schedules keep the first stage's embedding and the last stage's output layer as
two equal copies whose gradients are summed over the embedding group before the optimizer
step, as Megatron-LM does (``tied``); the asynchronous ones refuse tied embeddings. With
``clip_grad`` the synchronous schedules clip by the global gradient norm after those sums
(``PipelineScheme.clip``: each parameter's squares counted once over the pp group, one
4-byte all-reduce); the asynchronous ones refuse it. The per-rank traffic and model states
a case must measure are closed forms (``parbench.analytic.pipeline``, adapted in
``prediction``); the graphs and activation bytes a rank really holds are measured in the
executor (``activations``) and shown beside the simulator's and the paper's counts.
"""
from __future__ import annotations

from pathlib import Path

import torch

from parbench.batching import microbatches
from parbench.config import MODEL_FEATURES, CaseConfig, ConfigError
from parbench.model import build_stage, counted_tokens
from parbench.probes import reference_probes
from parbench.scheme import Prediction, Scheme
from parbench.timeline import as_dicts
from parbench.schedules import (
    KINDS,
    Action,
    ExecutorKind,
    GridEvent,
    Schedule,
    ScheduleError,
    TimelinePanel,
    events_from_sim,
    get_spec,
    make_schedule,
    plot_timeline,
    simulate,
    validate,
)
from parbench.schedules.actions import BACKWARD_FULL, FORWARD

from impls.common.clip import clip_grads_

from . import replicas
from .executor import Executor
from .metrics import bubble_metrics
from .prediction import pipeline_prediction, stage_chunks
from .tied import EMBD_AXIS, TiedEmbeddings, init_head_copy, reported_name
from .weights import StageSlot, SyncWeights, WeightRule


def schedule_for(case: CaseConfig, name: str) -> Schedule:
    """The schedule of a case (p = pp, m = num_microbatches, v from vpp), validated.

    The schedule's spec says how vpp maps to the generator's v (``ScheduleSpec.v_for``).
    """
    par = case.layout
    try:
        v = get_spec(name).v_for(par.vpp)
    except ScheduleError as e:
        raise ConfigError(str(e)) from None
    try:
        return validate(make_schedule(name, par.pp, par.num_microbatches, v))
    except ScheduleError as e:
        raise ConfigError(f"pp={par.pp}, num_microbatches={par.num_microbatches}, "
                          f"vpp={par.vpp}: {e}") from None


class PipelineScheme(Scheme):
    family = "pipeline"
    uses = ("pp",)
    options = ("vpp",)
    schedule_name = ""
    #: the executor class (the self-test's mutants swap in broken ones)
    executor_class = Executor
    #: the synchronous schedules clip by the global norm over the pp group (``clip``); the
    #: continuous ones (PipeDream, 2BW) turn it off
    supports_clip_grad = True
    #: every stage attends within the micro-batch's packed documents (the executor finds
    #: them in its tokens, which every rank holds); the token-slice and continuous schemes
    #: turn it off
    supports_packing = True
    #: masked loss normalised by the global batch's counted tokens (Megatron-LM's
    #: --calculate-per-token-loss); the asynchronous and segment schemes turn it off
    supports_loss_mask = True
    #: uneven end ranks, where the schedule allows them (``_check_uneven``)
    supports_uneven_stages = True
    model_features = MODEL_FEATURES | {"mla"}  # each stage is a slice of the reference model

    def __init__(self, ctx):
        super().__init__(ctx)
        cfg = ctx.model
        self.m = ctx.layout.num_microbatches
        self.schedule = self.case_schedule(ctx.case)
        self.group = ctx.mesh.group("pp")
        self.group_ranks = ctx.mesh.ranks("pp")
        self.pp_rank = ctx.mesh.index("pp")
        self.slots = {key: StageSlot(key[0], key[1], self.build_stage(key[1]).to(ctx.device))
                      for key in self.schedule.stages_of(self.pp_rank)}
        self.tied = self.make_tied() if cfg.tie_embeddings else None
        self.weights = self.make_weights()
        self.executor = self.make_executor()
        # compute events of the last checked step and every timed step after it
        #: (step, its compute events) of the measured steps
        self._step_events: list[tuple[int, list]] = []
        self._held: list[tuple[int, int]] = []  # (held graphs, activation bytes) per step
        # First use of the group by every member (NCCL creates communicators lazily).
        torch.distributed.barrier(group=self.group)

    def build_stage(self, stage: int):
        """Stage ``stage`` of the model: its layers (the even split, or the case's uneven
        ends, ``stage_chunks``), the embedding on the first stage, the head on the last."""
        cfg = self.ctx.model
        return build_stage(cfg, self.ctx.run.seed, stage, self.schedule.num_stages,
                           stage_chunks(self.ctx.case))

    @classmethod
    def case_schedule(cls, case: CaseConfig) -> Schedule:
        """The validated schedule this scheme runs for ``case`` (a mutant may swap it)."""
        return schedule_for(case, cls.schedule_name)

    def make_tied(self) -> TiedEmbeddings:
        """The tied word embedding's copies on this rank (``tied``): the last stage's copy
        initialised as the embedding; the embedding group created (collectively)."""
        init_head_copy(list(self.slots.values()), self.ctx.run.seed, self.ctx.model.init_std)
        return TiedEmbeddings(list(self.slots.values()), self.schedule, self.pp_rank,
                              self.ctx.mesh)

    def make_weights(self) -> WeightRule:
        """The weight rule of this scheme (synchronous; the asynchronous schemes override)."""
        return SyncWeights(list(self.slots.values()), self.ctx.run)

    def executed_schedule(self) -> tuple[Schedule, list | None]:
        """The rows the executor walks and, for a continuous run, the step bounds (None:
        the same schedule every step)."""
        return self.schedule, None

    def make_executor(self) -> Executor:
        cfg = self.ctx.model
        rows, bounds = self.executed_schedule()
        act_shape = (self.ctx.layout.micro_batch_size, cfg.seq_length, cfg.hidden_size)
        return self.executor_class(schedule=rows, pp_rank=self.pp_rank, group=self.group,
                                   group_ranks=self.group_ranks, slots=self.slots,
                                   act_shape=act_shape, dtype=torch.float32,
                                   device=self.ctx.device, timeline=self.ctx.timeline,
                                   weights=self.weights, m=self.m, bounds=bounds)

    # ---- step --------------------------------------------------------------------------
    def train_step(self, inputs, targets, step):
        device, timeline = self.ctx.device, self.ctx.timeline
        mbs = microbatches(inputs.to(device), targets.to(device), self.m)
        xs, ys = [x for x, _ in mbs], [y for _, y in mbs]
        checked = step < self.ctx.run.steps
        self.weights.step_begin()
        if self.ctx.run.loss_mask:  # Megatron-LM's --calculate-per-token-loss: N global
            self.executor.global_tokens = counted_tokens(targets)
        outcome = self.executor.run(xs, ys, step, track=checked)
        if checked:
            self._held.append((self.executor.peak_held, self.executor.peak_activation_bytes))
        if len(self.schedule.pipes) > 1:
            with timeline.span("sync"):
                self._sync_replicas()
        if self.tied is not None:
            with timeline.span(EMBD_AXIS):
                self._sync_tied()
        with timeline.span("optim"):
            self.clip()
            self.weights.step_end()
        if step >= self.ctx.run.steps - 1:  # converted to dicts once, in metrics()
            self._step_events.append((step, timeline.events_of("compute")))
        return self.reduce_loss(outcome.loss, self.group)

    def measured_events(self, events: list[dict], step: int) -> list[dict] | None:
        """This step's compute events as the metrics compare them (None: not comparable)."""
        return [e for e in events if e["cat"] == "compute"]

    def _partner(self) -> int:
        return self.schedule.p - 1 - self.pp_rank

    def _peer(self) -> int:
        return self.group_ranks[self._partner()]

    def _replica_slots(self) -> list[StageSlot]:
        """This rank's slots in exchange order: (pipe 0, r), (pipe 1, p-1-r)."""
        return replicas.in_exchange_order(self.slots)

    def _sync_replicas(self):
        """Add the two replicas' gradients of every stage (``replicas.sync_gradients``)."""
        replicas.sync_gradients(self.slots, self.group, self._peer())

    def _sync_tied(self):
        """Sum the tied embedding copies' gradients over the embedding group (``tied``)."""
        self.tied.sync_gradients()

    # ---- gradient clipping -------------------------------------------------------------
    def norm_owned(self) -> list[torch.Tensor]:
        """The gradients this rank adds to the global norm, so that the pp group counts every
        parameter of the model once: of a two-replica schedule only the pipe-0 copies (after
        the replica exchange both copies hold the stage's whole gradient), and of the tied
        word embedding only the first stage's copy (the output layer's copy holds the same
        summed gradient: Megatron-LM leaves it out of ``clip_grad_norm_fp32`` by its
        shared-embedding filter)."""
        slots = (list(self.slots.values()) if len(self.schedule.pipes) == 1
                 else self._replica_slots()[:1])
        heads = {id(w) for w in self.tied.heads} if self.tied is not None else set()
        return [p.grad for s in slots for p in s.params if id(p) not in heads]

    def clip(self) -> None:
        """Clip by global norm (``clip_grad``; Pascanu et al. 2013; Megatron-LM's
        ``clip_grad_norm_fp32`` over the model-parallel group): the squares of
        ``norm_owned`` all-reduced over pp (one 4-byte all-reduce), then every gradient this
        rank steps on, replica and tied copies included, scaled by the same factor, so the
        copies stay bit-identical. After the replica exchange and the tied sum."""
        if not self.ctx.run.clip_grad:
            return
        grads = [p.grad for s in self.slots.values() for p in s.params]
        clip_grads_(grads, self.ctx.run.clip_grad, owned=self.norm_owned(),
                    groups=[self.group])

    # ---- results -----------------------------------------------------------------------
    def _reported_slots(self, check_replicas: bool) -> list[StageSlot]:
        """The slots compared with the reference: all of them, or the pipe-0 copy of a
        two-replica schedule (after checking, if asked, that the pipe-1 copies agree)."""
        if len(self.schedule.pipes) == 1:
            return list(self.slots.values())
        return replicas.reported(self.slots, self.group, self._peer(), check_replicas)

    def full_params(self):
        tied = self.tied is not None
        return {reported_name(n, tied): p.detach()
                for s in self._reported_slots(check_replicas=True)
                for n, p in zip(s.names, self.weights.reported_params(s))}

    def full_grads(self):
        tied = self.tied is not None
        return {reported_name(n, tied): g.detach()
                for s in self._reported_slots(check_replicas=False)
                for n, g in zip(s.names, self.weights.reported_grads(s))}

    def module_probes(self):
        """Each stage's modules as probes (issue 20, sec. 5): a slot's i-th forward computes
        the rows of the i-th micro-batch it runs (``parbench.probes``; loss / m per
        micro-batch: the golden run's input gradients, ``grad_scale`` 1). None where the
        probes' call matching does not hold: a split backward (W re-enters the graph), a
        slot whose backwards run in another order than its forwards, two replicas of a
        stage on one rank (Chimera, DualPipe), token slices or a continuous run."""
        sched = self.schedule
        if sched.split_backward or sched.asynchronous or len(sched.pipes) > 1 \
                or sched.segments > 1:
            return None
        b, mine = self.ctx.layout.micro_batch_size, sched.actions[self.pp_rank]
        probes = []
        for key, slot in self.slots.items():
            runs = {kind: [a.mb for a in mine if a.kind == kind and (a.pipe, a.stage) == key]
                    for kind in (FORWARD, BACKWARD_FULL)}
            if runs[FORWARD] != runs[BACKWARD_FULL]:
                return None
            calls = [slice(mb * b, (mb + 1) * b) for mb in runs[FORWARD]]
            probes += reference_probes(slot.module, calls)
        return probes

    def metrics(self):
        held = max((h for h, _ in self._held), default=0)
        act = max((b for _, b in self._held), default=0)
        measured = (self.measured_events(as_dicts(events), step)
                    for step, events in self._step_events)
        steps = [e for e in measured if e is not None]
        return bubble_metrics(self.measured_schedule(), steps, self.group,
                              held=held, activation_bytes=act,
                              per_microbatch=self.activation_estimate())

    @classmethod
    def step_schedule(cls, case: CaseConfig) -> Schedule:
        """The schedule one measured step follows (metrics and figures simulate it)."""
        return schedule_for(case, cls.schedule_name)

    def measured_schedule(self) -> Schedule:
        return self.schedule

    def activation_estimate(self) -> list[float]:
        """Analytic activation bytes of one micro-batch on each stage this rank holds
        (``parbench.analytic.peak.activation_bytes``: Korthikanti et al. 2022 adapted)."""
        from parbench.analytic.peak import activation_bytes
        case, s = self.ctx.case, self.schedule
        chunks = stage_chunks(case) or [case.model.num_layers // s.num_stages] * s.num_stages
        return [activation_bytes(case, chunks[stage], 1, embedding=stage == 0,
                                 head=stage == s.num_stages - 1)
                for _, stage in s.stages_of(self.pp_rank)]

    # ---- before spawning ---------------------------------------------------------------
    @classmethod
    def check(cls, case: CaseConfig) -> None:
        super().check(case)
        par, model = case.layout, case.model
        if par.dp != 1:
            raise ConfigError(f"dp={par.dp}: pipeline schemes run one pipeline (set dp=1)")
        if case.run.dtype != "fp32":
            raise ConfigError(f"dtype={case.run.dtype!r}: pipeline schemes run fp32")
        if model.tie_embeddings and get_spec(cls.schedule_name).asynchronous:
            raise ConfigError(f"tie_embeddings=true: {cls.name} updates weights "
                              "asynchronously (weight stashing), whose reference run keeps "
                              "the output layer apart (set tie_embeddings=false)")
        if model.num_experts:
            raise ConfigError(f"num_experts={model.num_experts}: pipeline schemes run the "
                              "dense model")
        schedule = cls.case_schedule(case)
        if par.uneven:
            cls._check_uneven(case, schedule)
        elif model.num_layers % schedule.num_stages:
            raise ConfigError(f"num_layers={model.num_layers} is not divisible by the "
                              f"{schedule.num_stages} stages of {cls.schedule_name} with "
                              f"pp={par.pp}, vpp={schedule.v}")

    @classmethod
    def _check_uneven(cls, case: CaseConfig, schedule: Schedule) -> None:
        """Uneven end ranks (``first_stage_layers`` / ``last_stage_layers``): a synchronous
        schedule of the standard executor whose stages lie linearly or looped, one per
        (rank, chunk) -- where Megatron-Core's split names a rank's layers."""
        spec, par = get_spec(cls.schedule_name), case.layout
        if not spec.takes_uneven_stages or spec.asynchronous or \
                spec.executor is not ExecutorKind.STANDARD or \
                schedule.num_stages != par.pp * par.vpp:
            raise ConfigError(f"first_stage_layers={par.first_stage_layers}, "
                              f"last_stage_layers={par.last_stage_layers}: {cls.name} does "
                              "not run uneven end ranks (they need a synchronous schedule "
                              "with linear or looped stages, one per rank and chunk)")
        par.chunk_layers(case.model.num_layers)  # Megatron-Core's rules, named

    @classmethod
    def predict(cls, case: CaseConfig) -> Prediction:
        return pipeline_prediction(case, cls.schedule_name)

    @classmethod
    def figures(cls, case: CaseConfig, per_rank: list, out_dir) -> list[Path]:
        """The schedule as the papers draw it: simulated with unit costs above, the measured
        compute spans of the last checked step below."""
        schedule = cls.step_schedule(case)
        sim = simulate(schedule)
        measured = [dict(ev, rank=r.rank) for r in per_rank for ev in r.timeline
                    if ev["cat"] == "compute" and ev["kind"] in KINDS]
        t0 = min((e["start"] for e in measured), default=0.0)
        measured_events = [
            GridEvent(e["rank"], e["kind"], e["mb"], e["stage"], (e["start"] - t0) * 1e3,
                      (e["end"] - t0) * 1e3, e.get("meta", {}).get("pipe", 0))
            for e in measured]
        name = f"{schedule.name} p={schedule.p} m={schedule.m} v={schedule.v}"
        panels = [
            TimelinePanel(events_from_sim(sim),
                          f"{name}: simulated, unit costs (bubble {sim.bubble:.3f})",
                          "time (T_F units)"),
            TimelinePanel(measured_events, f"{name}: measured (last checked step)",
                          "time (ms)"),
        ]

        def label(e: GridEvent) -> str:  # the micro-batch, with the chunk where v > 1
            return schedule.label(Action(e.kind, e.mb, e.stage, e.pipe)).lstrip("FBW")

        safe = (case.id or cls.schedule_name).replace(":", "_").replace("/", "_")
        path = Path(out_dir) / "figures" / f"schedule_{safe}.png"
        return [plot_timeline(panels, path, ranks=schedule.p, label=label)]
