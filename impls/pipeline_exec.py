"""The one pipeline executor: runs any `parbench.schedules.Schedule` on real ranks.

Each rank walks its own action list in order (the same model the simulator and the
validator use, so a validated schedule cannot deadlock here):

* before an action, the receives it needs are posted and waited for; the send produced by
  the previous action is posted in the same ``batch_isend_irecv`` (Megatron's
  ``send_forward_recv_backward`` pattern, which keeps NCCL from deadlocking when two
  neighbours exchange at once);
* sends are asynchronous and only waited for at the end of the step;
* messages between two ranks are matched in the order the *sender* produces them
  (gloo and NCCL match point-to-point messages between a pair in posting order). A
  receiver that needs a later message first posts receives for the earlier ones, so a
  schedule may consume a neighbour's messages in any order;
* a transfer between two stages on the same rank is a local hand-off (no traffic).

Compute actions: ``F`` (forward of one micro-batch through one stage), ``BW`` (fused
backward), ``B`` and ``W`` (split backward, see ``pipeline_split``). Every action is a
timeline span ``F/B/W/BW`` with its micro-batch, stage and pipe. The loss of each
micro-batch is scaled by 1/m so that accumulated gradients equal the full-batch mean.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.func import functional_call

from parbench.schedules import Schedule

from .pipeline_split import SplitBackward, fused_grads


@dataclass
class StageSlot:
    """One (pipe, stage) held by this rank: its module and parameter list."""

    pipe: int
    stage: int
    module: torch.nn.Module
    names: list[str] = field(default_factory=list)
    params: list[torch.Tensor] = field(default_factory=list)

    def __post_init__(self):
        pairs = list(self.module.named_parameters())
        self.names = [n for n, _ in pairs]
        self.params = [p for _, p in pairs]


class SyncWeights:
    """Synchronous semantics: one weight version; gradients accumulate into ``p.grad``."""

    def forward_params(self, slot: StageSlot, mb: int):
        return None  # the module's own parameters

    def on_grads(self, slot: StageSlot, mb: int, params, grads) -> None:
        for p, g in zip(params, grads):
            if g is not None:
                p.grad.add_(g)

    def step_begin(self, slots) -> None:
        for slot in slots:
            for p in slot.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                else:
                    p.grad.zero_()


def stage_forward(module, inp, targets, param_dict=None):
    """Forward of one stage: returns (boundary, output).

    The boundary is the tensor B differentiates with respect to: the received input, or on
    the first stage the embedding output (so the first stage's B covers its blocks and its W
    the embedding and all weights). With ``param_dict`` (a stashed weight version) the stage
    runs through ``functional_call`` and only fused backward is supported on the first stage.
    """
    if param_dict is not None:
        out = functional_call(module, param_dict, (inp, targets))
        return (None if module.first else inp), out
    if module.first:
        boundary = module.embed(inp)
    else:
        boundary = inp
    h = boundary
    for blk in module.blocks.values():
        h = blk(h)
    out = module.head(h, targets) if module.last else h
    return boundary, out


def _produced(schedule: Schedule, rank: int):
    """(transfer key, destination rank) produced by each action of ``rank``, in order."""
    S = schedule.num_stages
    out = []
    for a in schedule.actions[rank]:
        key = dst = None
        if a.kind == "F" and a.stage < S - 1:
            dst = schedule.placement[(a.pipe, a.stage + 1)]
            key = ("act", a.mb, a.stage, a.pipe)
        elif a.kind in ("B", "BW") and a.stage > 0:
            dst = schedule.placement[(a.pipe, a.stage - 1)]
            key = ("grad", a.mb, a.stage, a.pipe)
        out.append((key, dst if dst != rank else None))
    return out


def needed_key(schedule: Schedule, a) -> tuple | None:
    """The transfer key an action consumes (activation or output gradient), if any."""
    if a.kind == "F" and a.stage > 0:
        return ("act", a.mb, a.stage - 1, a.pipe)
    if a.kind in ("B", "BW") and a.stage < schedule.num_stages - 1:
        return ("grad", a.mb, a.stage + 1, a.pipe)
    return None


class Executor:
    """Runs ``schedule`` for this rank (``me`` = index in the pp group)."""

    def __init__(self, schedule: Schedule, me: int, group, group_ranks: list[int],
                 slots: dict[tuple[int, int], StageSlot], act_shape, dtype, device,
                 timeline, weights=None):
        self.s = schedule
        self.me = me
        self.group = group
        self.global_rank = list(group_ranks)
        self.slots = slots
        self.shape = tuple(act_shape)
        self.dtype = dtype
        self.device = device
        self.timeline = timeline
        self.weights = weights or SyncWeights()
        self.sync_cuda = device.type == "cuda"
        produced = _produced(schedule, me)
        self.row = schedule.actions[me]
        self.sends = [(k, d) for k, d in produced]
        # receive queues: per source rank, keys addressed to me in the source's order
        self.recv_order: dict[int, list[tuple]] = {}
        self.recv_src: dict[tuple, int] = {}
        for src in range(schedule.p):
            if src == me:
                continue
            keys = [k for k, d in _produced(schedule, src) if d == me]
            if keys:
                self.recv_order[src] = keys
                for k in keys:
                    self.recv_src[k] = src
        self.peak_inflight = 0

    # ---- point-to-point ----------------------------------------------------------------
    def _post(self, ops: list, recv_keys: list) -> None:
        """Post a batch; remember the work that completes each received key."""
        if not ops:
            return
        works = dist.batch_isend_irecv([op for op, _ in ops])
        per_op = len(works) == len(ops)
        for i, (op, key) in enumerate(ops):
            if key is None:  # a send: keep the tensor alive until the end of the step
                self._send_works.append((works[i] if per_op else None, op.tensor))
            else:
                self._recv_work[key] = [works[i]] if per_op else list(works)
        if not per_op:
            self._send_works.append((None, None))
            self._coalesced.extend(works)

    def _recv_ops(self, key) -> list:
        """Receive ops for ``key`` and every earlier message from the same sender."""
        if key is None or key in self._local or key in self._recv_buf:
            return []
        src = self.recv_src[key]
        queue = self.recv_order[src]
        ops = []
        while self._next_recv[src] < len(queue):
            k = queue[self._next_recv[src]]
            self._next_recv[src] += 1
            buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            self._recv_buf[k] = buf
            ops.append((dist.P2POp(dist.irecv, buf, self.global_rank[src], self.group), k))
            if k == key:
                break
        return ops

    def _take(self, key) -> torch.Tensor | None:
        if key is None:
            return None
        if key in self._local:
            return self._local.pop(key)
        for w in self._recv_work.pop(key):
            w.wait()
        return self._recv_buf.pop(key)

    # ---- one step ----------------------------------------------------------------------
    def run(self, xs: list[torch.Tensor], ys: list[torch.Tensor]) -> dict:
        """Run every action of this rank for one step; returns the summed micro-batch losses
        (scaled by 1/m, last stages only) and peak in-flight micro-batches."""
        m = self.s.m
        self._local, self._recv_buf, self._recv_work = {}, {}, {}
        self._send_works, self._coalesced = [], []
        self._next_recv = {src: 0 for src in self.recv_order}
        ctx: dict[tuple, dict] = {}
        pending: list = []
        loss_sum = torch.zeros((), dtype=torch.float64)
        inflight = peak = 0
        tl = self.timeline
        for a, (out_key, dst) in zip(self.row, self.sends):
            need = needed_key(self.s, a)
            ops = pending + self._recv_ops(need)
            pending = []
            self._post(ops, [])
            received = self._take(need)
            slot = self.slots[(a.pipe, a.stage)]
            key = (a.mb, a.stage, a.pipe)
            with tl.span(a.kind, mb=a.mb, stage=a.stage, pipe=a.pipe):
                if a.kind == "F":
                    inp = xs[a.mb] if slot.module.first else received.requires_grad_(True)
                    pdict = self.weights.forward_params(slot, a.mb)
                    boundary, out = stage_forward(slot.module, inp, ys[a.mb], pdict)
                    params = slot.params if pdict is None else list(pdict.values())
                    if slot.module.last:
                        loss_sum += float(out.detach())
                        out = out / m
                    ctx[key] = {"boundary": boundary, "out": out, "params": params}
                    inflight += 1
                    peak = max(peak, inflight)
                    produced = None if slot.module.last else out.detach()
                elif a.kind == "BW":
                    c = ctx.pop(key)
                    dx, grads = fused_grads(c["out"], c["boundary"] if a.stage > 0 else None,
                                            c["params"], received)
                    self.weights.on_grads(slot, a.mb, c["params"], grads)
                    inflight -= 1
                    produced = dx
                elif a.kind == "B":
                    c = ctx[key]
                    split = SplitBackward(c["out"], c["boundary"], c["params"])
                    dx = split.input_grad(received)
                    c.clear()
                    c["split"], c["params"] = split, split.params
                    inflight -= 1
                    produced = dx if a.stage > 0 else None
                else:  # W
                    c = ctx.pop(key)
                    grads = c["split"].weight_grads()
                    self.weights.on_grads(slot, a.mb, c["params"], grads)
                    produced = None
                if self.sync_cuda:
                    torch.cuda.synchronize(self.device)
            if out_key is not None:
                t = produced.detach()
                if dst is None:
                    self._local[out_key] = t
                else:
                    t = t.contiguous()
                    pending.append((dist.P2POp(dist.isend, t, self.global_rank[dst],
                                               self.group), None))
        self._post(pending, [])
        for w, _ in self._send_works:
            if w is not None:
                w.wait()
        for w in self._coalesced:
            w.wait()
        leftover = [k for k in self._recv_buf]
        if ctx or leftover or self._local:
            raise RuntimeError(f"pipeline executor: rank {self.me} ended the step with "
                               f"unfinished work: {sorted(ctx)[:4]} {leftover[:4]} "
                               f"{sorted(self._local)[:4]}")
        self._send_works, self._coalesced = [], []
        self.peak_inflight = peak
        return {"loss_sum": float(loss_sum) / m, "peak_inflight": peak}
