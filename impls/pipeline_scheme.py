"""Pipeline parallelism: every schedule of ``parbench.schedules`` run by one executor.

Schemes ``pipeline.<name>`` for gpipe, 1f1b, interleaved, zb-h1, zb-h2, zbv, chimera,
dualpipe, dualpipev, bfs, pipedream and 2bw. The model is cut into S consecutive stages
(``parbench.model.build_stage``; S = p for one-stage-per-rank and bidirectional schedules,
p*v for interleaved / looped BFS, 2p for the V shapes); a rank holds the stages the
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
(``pipeline_async``).

Traffic per step on axis pp (Narayanan et al. 2021, PTD-P Sec. 2.2): one b*s*h activation
per stage boundary that crosses ranks per micro-batch forward, one gradient of the same size
backward -- every cross-rank transfer of ``Schedule.comm()`` -- plus the replica gradient
exchange of the bidirectional schedules.
"""
from __future__ import annotations

import contextlib

import torch

from parbench.config import CaseConfig, ConfigError
from parbench.model import build_stage
from parbench.scheme import Scheme
from parbench.schedules import ScheduleError, make_schedule, validate

from .common import microbatches
from .pipeline_exec import Executor, StageSlot, SyncWeights
from .pipeline_metrics import bubble_metrics, stage_counts

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zbv", "chimera",
                  "dualpipe", "dualpipev", "bfs", "pipedream", "2bw")
#: schedules whose number of chunks per rank is fixed by the shape (vpp=1 or 2 accepted)
V_SHAPED = ("zbv", "dualpipev")
CHUNKED = ("interleaved", "bfs")
ASYNC = ("pipedream", "2bw")


def schedule_for(case: CaseConfig, name: str):
    """The schedule of a case (p = pp, m = num_microbatches, v = vpp), validated."""
    p = case.parallel
    if name in V_SHAPED:
        if p.vpp not in (1, 2):
            raise ConfigError(f"vpp={p.vpp}: {name} always holds 2 stages per rank "
                              "(use vpp=1 or vpp=2)")
        v = None
    elif name in CHUNKED:
        v = p.vpp if p.vpp > 1 else None
    else:
        if p.vpp != 1:
            raise ConfigError(f"vpp={p.vpp}: {name} holds one stage per rank per replica "
                              "(set vpp=1)")
        v = None
    try:
        return validate(make_schedule(name, p.pp, p.num_microbatches, v))
    except ScheduleError as e:
        raise ConfigError(f"pp={p.pp}, num_microbatches={p.num_microbatches}, vpp={p.vpp}: "
                          f"{e}") from None


class PipelineScheme(Scheme):
    family = "pipeline"
    uses = ("pp",)
    schedule_name = ""

    def __init__(self, ctx):
        super().__init__(ctx)
        cfg, run = ctx.model, ctx.run
        self.schedule = schedule_for(ctx.case, self.schedule_name)
        self.group = ctx.mesh.group("pp")
        self.group_ranks = ctx.mesh.ranks("pp")
        self.me = ctx.mesh.index("pp")
        S = self.schedule.num_stages
        self.slots = {key: StageSlot(key[0], key[1],
                                     build_stage(cfg, run.seed, key[1], S).to(ctx.device))
                      for key in self.schedule.stages_of(self.me)}
        self.weights = self._make_weights()
        shape = (ctx.parallel.micro_batch_size, cfg.seq_length, cfg.hidden_size)
        self.executor = Executor(self.schedule, self.me, self.group, self.group_ranks,
                                 self.slots, shape, torch.float32, ctx.device, ctx.timeline,
                                 self.weights)
        # compute events of the last checked step and every timed step after it
        self._step_events: list[list[dict]] = []
        # First use of the group by every member (NCCL creates communicators lazily).
        torch.distributed.barrier(group=self.group)

    def _make_weights(self):
        return SyncWeights(list(self.slots.values()), self.ctx.run)

    # ---- step --------------------------------------------------------------------------
    def train_step(self, inputs, targets, step):
        m = self.schedule.m
        dev = self.ctx.device
        mbs = microbatches(inputs.to(dev), targets.to(dev), m)
        xs, ys = [x for x, _ in mbs], [y for _, y in mbs]
        tl = self.ctx.timeline
        self.weights.step_begin(list(self.slots.values()))
        res = self.executor.run(xs, ys)
        if len(self.schedule.pipes) > 1:
            with tl.span("sync"):
                self._sync_replicas()
        with tl.span("optim"):
            self.weights.step_end()
        if step >= self.ctx.run.steps - 1:
            self._step_events.append([e for e in tl.as_dicts() if e["cat"] == "compute"])
        return self.reduce_loss(res["loss_sum"], self.group)

    def _partner(self) -> int:
        return self.schedule.p - 1 - self.me

    def _replica_slots(self):
        """This rank's slots in exchange order: (pipe 0, r), (pipe 1, p-1-r)."""
        return [self.slots[k] for k in sorted(self.slots)]

    def _exchange(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """Send the concatenation of ``tensors`` to the partner rank and receive its own."""
        dist = torch.distributed
        flat = torch.cat([t.reshape(-1) for t in tensors])
        other = torch.empty_like(flat)
        peer = self.group_ranks[self._partner()]
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, flat, peer, self.group),
                                        dist.P2POp(dist.irecv, other, peer, self.group)])
        for w in works:
            w.wait()
        return other

    def _sync_replicas(self):
        """Add the two replicas' gradients of every stage (pipe 0 + pipe 1 on both ranks)."""
        mine = self._replica_slots()  # [(0, r), (1, p-1-r)]
        grads = [p.grad for s in mine for p in s.params]
        other = self._exchange(grads)
        # partner sent [(0, p-1-r), (1, r)]: its first part pairs with my (1, p-1-r)
        n_far = sum(p.numel() for p in mine[1].params)
        theirs = {mine[1].stage: other[:n_far], mine[0].stage: other[n_far:]}
        for slot in mine:
            off, buf = 0, theirs[slot.stage]
            for p in slot.params:
                g = buf[off:off + p.numel()].view_as(p)
                off += p.numel()
                p.grad.copy_(p.grad + g if slot.pipe == 0 else g + p.grad)

    # ---- results -----------------------------------------------------------------------
    def _reported_slots(self):
        if len(self.schedule.pipes) == 1:
            return list(self.slots.values())
        # two replicas: report the pipe-0 copy after checking the pipe-1 copies agree
        from parbench import comm
        mine = self._replica_slots()
        led = comm.active()
        with led.pause() if led is not None else contextlib.nullcontext():
            other = self._exchange([p.detach() for s in mine for p in s.params])
        n_far = sum(p.numel() for p in mine[1].params)
        far = torch.cat([p.detach().reshape(-1) for p in mine[1].params])
        if not torch.equal(far, other[:n_far]):
            raise RuntimeError(f"rank {self.me}: the two replicas of stage {mine[1].stage} "
                               "differ after the gradient synchronisation")
        return [mine[0]]

    def full_params(self):
        return {n: p.detach() for s in self._reported_slots() for n, p in
                zip(s.names, s.params)}

    def full_grads(self):
        slots = list(self.slots.values()) if len(self.schedule.pipes) == 1 else \
            [self._replica_slots()[0]]
        return {n: p.grad.detach() for s in slots for n, p in zip(s.names, s.params)}

    def state_tensors(self):
        return self.weights.state_tensors()

    def extra_metrics(self):
        return bubble_metrics(self.schedule, self._step_events, self.group,
                              self.executor.peak_inflight)

    # ---- before spawning ---------------------------------------------------------------
    @classmethod
    def check(cls, case: CaseConfig) -> None:
        super().check(case)
        p, m = case.parallel, case.model
        if p.dp != 1:
            raise ConfigError(f"dp={p.dp}: pipeline schemes run one pipeline (set dp=1)")
        if case.run.dtype != "fp32":
            raise ConfigError(f"dtype={case.run.dtype!r}: pipeline schemes run fp32")
        if m.tie_embeddings:
            raise ConfigError("tie_embeddings=true: pipeline stages do not share the "
                              "embedding with the head (set tie_embeddings=false)")
        if m.num_experts:
            raise ConfigError(f"num_experts={m.num_experts}: pipeline schemes run the dense model")
        sched = schedule_for(case, cls.schedule_name)
        if m.num_layers % sched.num_stages:
            raise ConfigError(f"num_layers={m.num_layers} is not divisible by the "
                              f"{sched.num_stages} stages of {cls.schedule_name} with "
                              f"pp={p.pp}, vpp={sched.v}")

    @classmethod
    def predict(cls, case: CaseConfig) -> dict:
        return pipeline_prediction(case, schedule_for(case, cls.schedule_name),
                                   cls.extra_state_bytes)

    @classmethod
    def write_figures(cls, case: CaseConfig, per_rank: list[dict], out_dir) -> list:
        """The schedule as the papers draw it: simulated and measured (see pipeline_figures)."""
        from pathlib import Path

        from .pipeline_figures import write_schedule_figure
        safe = (case.id or cls.schedule_name).replace(":", "_").replace("/", "_")
        path = Path(out_dir) / "figures" / f"schedule_{safe}.png"
        return [write_schedule_figure(schedule_for(case, cls.schedule_name), per_rank, path)]

    @staticmethod
    def extra_state_bytes(case, schedule, rank, counts) -> dict:
        """Model-state categories beyond params/grads/optimizer (async weight versions)."""
        return {}


def pipeline_prediction(case: CaseConfig, schedule, extra=None) -> dict:
    """Per-rank p2p wire bytes and model-state bytes of one step (exact, fp32)."""
    cfg, par, run = case.model, case.parallel, case.run
    act = par.micro_batch_size * cfg.seq_length * cfg.hidden_size * 4
    S = schedule.num_stages
    counts = {s: stage_counts(cfg, s, S) for s in range(S)}
    sends = [0] * schedule.p
    for t in schedule.comm():
        sends[t.src_rank] += act
    per_rank_wire, per_rank_states = [], []
    for r in range(schedule.p):
        held = schedule.stages_of(r)
        numel = sum(counts[s][0] for _, s in held)
        ntensors = sum(counts[s][1] for _, s in held)
        wire = sends[r] + (4 * numel if len(schedule.pipes) > 1 else 0)
        per_rank_wire.append({"pp": float(wire)})
        states = {"params": 4 * numel, "grads": 4 * numel,
                  "optimizer": 8 * numel + 4 * ntensors if run.optimizer == "adamw" else 0}
        if extra is not None:
            states.update(extra(case, schedule, r, counts))
        per_rank_states.append(states)
    return {"wire_bytes": {"pp": max(w["pp"] for w in per_rank_wire)},
            "wire_bytes_per_rank": per_rank_wire,
            "model_state_bytes": per_rank_states[0],
            "model_state_bytes_per_rank": per_rank_states,
            "p2p_bytes_per_transfer": act,
            "schedule": {"name": schedule.name, "p": schedule.p, "m": schedule.m,
                         "v": schedule.v, "num_stages": S}}
