"""BPipe (Kim, Kim, Yu, Chun 2023, ICML): 1F1B with activations balanced across stage pairs.

Scheme ``pipeline.bpipe``: the 1F1B executor (``executor``) on the ``bpipe`` schedule (1F1B's
compute order) plus the pair operations of ``parbench.schedules.bpipe.eviction_plan``. Stage x
< p/2 (evictor) and stage p-1-x (acceptor) share two two-rank groups, one per direction (axes
``bpipe_evict`` and ``bpipe_load`` in the ledger, so NCCL runs the two directions on separate
communicators and streams and neither queues behind the other):

* evict: after F(j) the evictor sends its saved storages of micro-batch j
  (``bpipe_memory.EvictableActivations``: one flat uint8 message) and, at the start of its
  next action, once the send is done, releases them (resized to 0 bytes);
* accept / give back / release: the acceptor receives the message into a buffer it holds,
  sends it back when the plan says and drops it once that send is done;
* load: at the start of BW(j) the evictor receives the message, resizes its storages back
  and refills them, and the backward runs on the same graph.

Everything is still checked against the golden run (the restored bytes are the evicted ones,
so gradients are bit-identical to 1F1B's). Each rank's peak of resident activation bytes is
measured twice in the same run -- as held (BPipe) and as if nothing were evicted (1F1B) --
and printed in the row beside BPipe's bound; the evict and load bytes are predicted by
``parbench.analytic.pipeline_bpipe`` from the paper's rule.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from parbench.config import CaseConfig
from parbench.model import documents_of
from parbench.scheme import Prediction, register
from parbench.schedules.bpipe import (
    ACCEPT,
    EVICT,
    GIVE_BACK,
    PAIR_OPS,
    EvictionPlan,
    eviction_plan,
    partner,
)
from parbench.schedules.actions import FORWARD

from .bpipe_memory import EvictableActivations
from .executor import Executor, stage_forward
from .metrics import _gather
from .scheme import PipelineScheme

EVICT_AXIS, LOAD_AXIS = "bpipe_evict", "bpipe_load"


class BPipeExecutor(Executor):
    """The executor with BPipe's pair operations at the positions the plan gives."""

    def __init__(self, *, plan: EvictionPlan, evict_group, load_group, peer: int,
                 message_bytes: dict[int, int], **kw):
        super().__init__(**kw)
        self.plan = plan
        self.evict_group, self.load_group = evict_group, load_group
        self.peer = peer  # the partner's global rank
        self.message_bytes = message_bytes  # evictor pp rank -> bytes of one micro-batch
        self.activations = EvictableActivations()
        self.mine = set(plan.evicted.get(self.pp_rank, ()))
        self._ops: dict[tuple, list] = {}
        for o in plan.ops[self.pp_rank]:
            self._ops.setdefault((o.at, o.when), []).append(o)
        self._pending: dict[tuple, tuple] = {}

    def run(self, xs, ys, step=0, track=True):
        # the saved-tensor hooks are what BPipe evicts through: always on
        return super().run(xs, ys, step, track=True)

    def _key(self, mb: int) -> tuple:
        return (mb, self.pp_rank, 0)

    def _do(self, at: int, when: str) -> None:
        for o in self._ops.get((at, when), ()):
            getattr(self, f"_{o.kind}")(o.mb, o.peer)  # _evict, _free, ..., _release

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        missing = [k for k in PAIR_OPS if not callable(getattr(cls, f"_{k}", None))]
        if missing:
            raise TypeError(f"{cls.__name__} lacks the pair operations {missing}")

    def _before_action(self, k, a) -> None:
        self._do(k, "start")
        capture = a.kind == FORWARD and a.mb in self.mine
        self.activations.capture = self._key(a.mb) if capture else None

    def _after_action(self, k, a) -> None:
        self.activations.capture = None
        self._do(k, "end")

    def _after_row(self, hi) -> None:
        self._do(hi, "start")
        if self._pending:
            raise RuntimeError(f"bpipe: rank {self.pp_rank} ended the step with pair "
                               f"operations open: {sorted(self._pending)[:4]}")

    # ---- the evictor ---------------------------------------------------------------------
    def _evict(self, mb: int, peer: int) -> None:
        flat = self.activations.pack_handle(self._key(mb))
        expected = self.message_bytes[self.pp_rank]
        if flat.numel() != expected:
            raise RuntimeError(f"bpipe: micro-batch {mb} saved {flat.numel()} bytes on stage "
                               f"{self.pp_rank}, the dry forward {expected}")
        work = dist.isend(flat, self.peer, group=self.evict_group)
        self._pending[(EVICT, mb)] = (work, flat)

    def _free(self, mb: int, peer: int) -> None:
        work, _ = self._pending.pop((EVICT, mb))
        work.wait()
        self.activations.drop(self._key(mb))

    def _load(self, mb: int, peer: int) -> None:
        flat = torch.empty(self.message_bytes[self.pp_rank], dtype=torch.uint8,
                           device=self.device)
        dist.irecv(flat, self.peer, group=self.load_group).wait()
        self.activations.restore(self._key(mb), flat)

    # ---- the acceptor --------------------------------------------------------------------
    def _accept(self, mb: int, peer: int) -> None:
        n = self.message_bytes[peer]
        buf = torch.empty(n, dtype=torch.uint8, device=self.device)
        work = dist.irecv(buf, self.peer, group=self.evict_group)
        self.activations.hold(n)
        self._pending[(ACCEPT, mb)] = (work, buf)

    def _give_back(self, mb: int, peer: int) -> None:
        work, buf = self._pending.pop((ACCEPT, mb))
        work.wait()
        self._pending[(GIVE_BACK, mb)] = (dist.isend(buf, self.peer, group=self.load_group),
                                          buf)

    def _release(self, mb: int, peer: int) -> None:
        work, buf = self._pending.pop((GIVE_BACK, mb))
        work.wait()
        self.activations.unhold(buf.numel())


def pair_partition(ranks: list[int]) -> list[list[int]]:
    """The pp group's ranks paired stage x with stage p-1-x (odd p: the middle alone)."""
    p = len(ranks)
    return [sorted({ranks[x], ranks[partner(p, x)]}) for x in range((p + 1) // 2)]


class BPipeScheme(PipelineScheme):
    name = "pipeline.bpipe"
    schedule_name = "bpipe"
    supports_loss_mask = False  # not yet: its own train_step does not set the token count
    description = ("BPipe (Kim et al. 2023): 1F1B, activations evicted from stage x to stage "
                   "p-1-x after the forward and loaded back before the backward")
    executor_class = BPipeExecutor

    def make_plan(self) -> EvictionPlan:
        """The evictions and pair operations this rank's executor follows."""
        return eviction_plan(self.schedule)

    def make_executor(self) -> Executor:
        ctx = self.ctx
        self.plan = self.make_plan()
        parts = pair_partition(ctx.mesh.ranks("pp"))
        others = [[r] for r in range(dist.get_world_size()) if r not in ctx.mesh.ranks("pp")]
        evict_group = ctx.mesh.subgroup(EVICT_AXIS, parts + others)
        load_group = ctx.mesh.subgroup(LOAD_AXIS, parts + others)
        self.message_bytes = self._exchange_saved_bytes()
        self._peaks: list[tuple[int, int]] = []  # (1F1B bytes, BPipe micro-batches) per step
        cfg = ctx.model
        act_shape = (ctx.layout.micro_batch_size, cfg.seq_length, cfg.hidden_size)
        peer = self.group_ranks[partner(self.schedule.p, self.pp_rank)]
        return self.executor_class(
            plan=self.plan, evict_group=evict_group, load_group=load_group, peer=peer,
            message_bytes=self.message_bytes, schedule=self.schedule, pp_rank=self.pp_rank,
            group=self.group, group_ranks=self.group_ranks, slots=self.slots,
            act_shape=act_shape, dtype=torch.float32, device=ctx.device,
            timeline=ctx.timeline, weights=self.weights, m=self.m)

    def _dry_saved_bytes(self) -> int:
        """Bytes autograd saves for one micro-batch on this rank's stage: one forward on
        zeros, counted by the same hooks (nothing is kept and no gradient is made)."""
        (slot,) = self.slots.values()
        cfg, b = self.ctx.model, self.ctx.layout.micro_batch_size
        tokens = torch.zeros(b, cfg.seq_length, dtype=torch.long, device=self.ctx.device)
        inp = tokens if slot.module.first else torch.zeros(
            b, cfg.seq_length, cfg.hidden_size, device=self.ctx.device, requires_grad=True)
        probe = EvictableActivations()
        with probe.forward([*slot.params, tokens]):
            out = stage_forward(slot.module, inp, tokens, docs=documents_of(cfg, tokens))
        nbytes = probe.bytes
        del out, inp
        return nbytes

    def _exchange_saved_bytes(self) -> dict[int, int]:
        """Every stage's saved bytes per micro-batch (setup, outside the ledger)."""
        mine = self._dry_saved_bytes()
        return dict(enumerate(_gather(mine, self.group)))

    def train_step(self, inputs, targets, step):
        loss = super().train_step(inputs, targets, step)
        if step < self.ctx.run.steps:
            acts = self.executor.activations
            self._peaks.append((acts.peak_unevicted, acts.peak_resident))
        return loss

    def metrics(self):
        out = super().metrics()
        rows = _gather({"bytes": max((b for _, b in self._held), default=0),
                        "graphs": max((h for h, _ in self._held), default=0),
                        "unevicted": max((u for u, _ in self._peaks), default=0),
                        "resident": max((r for _, r in self._peaks), default=0)}, self.group)
        p, limit = self.schedule.p, self.plan.threshold
        before = [r["graphs"] for r in rows]
        after = [r["resident"] for r in rows]
        out["activation_peak_bytes_1f1b"] = [r["unevicted"] for r in rows]
        out["bpipe"] = {
            "threshold_microbatches": limit,
            "evicted_per_stage": [len(self.plan.evicted.get(r, ())) for r in range(p)],
            "saved_bytes_per_microbatch": [self.message_bytes[r] for r in range(p)],
            "peak_microbatches_1f1b": before,
            "peak_microbatches_bpipe": after,
            "peak_bytes_1f1b": [r["unevicted"] for r in rows],
            "peak_bytes_bpipe": [r["bytes"] for r in rows],
            "paper": f"1F1B: stage s holds p-s micro-batches (heaviest {max(before)}); BPipe: "
                     f"every stage at most ceil((p+2)/2) = {limit}",
        }

        def fmt(values):
            return "/".join(str(v) for v in values)
        out["activation_balance"] = (
            f"micro-batches resident 1F1B {fmt(before)} -> BPipe {fmt(after)} (bound {limit}); "
            f"bytes {fmt(out['activation_peak_bytes_1f1b'])} -> {fmt(r['bytes'] for r in rows)}")
        return out

    @classmethod
    def predict(cls, case: CaseConfig) -> Prediction:
        from .bpipe_prediction import bpipe_prediction
        return bpipe_prediction(case)


register(BPipeScheme)
