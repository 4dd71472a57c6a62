"""The one pipeline executor: runs any `parbench.schedules.Schedule` on real ranks.

Each rank walks its own action list in order (the same model the simulator and the
validator use, so a validated schedule cannot deadlock here):

* before an action, the receives it needs are posted and waited for; the send produced by
  the previous action is posted in the same ``batch_isend_irecv`` (Megatron's
  ``send_forward_recv_backward`` pattern, which keeps NCCL from deadlocking when two
  neighbours exchange at once); on gloo the receives of the next action are posted too, so
  the transfer overlaps this action's compute;
* sends are asynchronous and only waited for at the end of the step -- of the run, for a
  continuous pipeline (PipeDream, 2BW: ``parbench.schedules.continuous``), whose rows span
  the whole run and are executed one step's slice at a time: the micro-batches in flight,
  the receives posted and the sends not yet matched carry over to the next step (the
  harness's barrier between steps is on another group, so a pending send on the pp group
  does not block it), and the last step drains;
* messages between two ranks are matched in the order the *sender* produces them
  (gloo and NCCL match point-to-point messages between a pair in posting order). A
  receiver that needs a later message first posts receives for the earlier ones, so a
  schedule may consume a neighbour's messages in any order;
* a transfer between two stages on the same rank is a local hand-off (no traffic).

Compute actions: ``F`` (forward of one micro-batch through one stage), ``BW`` (fused
backward), ``B`` and ``W`` (split backward, see ``split_backward``; on the first stage, whose
input gradient nobody needs, B is empty and W is the whole backward). Every action is a
timeline span ``F/B/W/BW`` with its micro-batch, stage and pipe. The loss of each
micro-batch is divided by m so that accumulated gradients equal the full-batch mean (the
weight rule decides: ``loss_divisor``; PipeDream, which updates after every micro-batch,
uses 1). The weight rule (a ``weights.WeightRule``) chooses the parameters a forward runs on
and receives the gradients of every backward. Each forward runs under the
``activations.HeldActivations`` hooks (when ``track`` is on), which measure the graphs the
rank holds and their saved bytes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.func import functional_call

from parbench.schedules import Schedule
from parbench.schedules.actions import (
    BACKWARD_FULL,
    BACKWARD_INPUT,
    FORWARD,
    INPUT_GRAD_KINDS,
)

from .activations import HeldActivations
from .split_backward import SplitBackward, fused_backward_into_grad, fused_grads
from .weights import StageSlot, WeightRule


@dataclass(frozen=True)
class StepOutcome:
    """What one step of the executor returns on one rank."""

    #: mean over the m micro-batches of the loss of this rank's last stages (0 elsewhere)
    loss: float


def stage_forward(module, inp, targets, param_dict=None):
    """Forward of one stage: returns (boundary, output).

    The boundary is the tensor B differentiates with respect to: the received input (None on
    the first stage, whose input is tokens). With ``param_dict`` (a stashed weight version,
    PipeDream) the stage runs on those tensors through ``functional_call``.
    """
    if param_dict is not None:
        out = functional_call(module, param_dict, (inp, targets))
    else:
        out = module(inp, targets)
    return (None if module.first else inp), out


def _produced(schedule: Schedule, rank: int):
    """(transfer key, destination rank) produced by each action of ``rank``, in order."""
    last_stage = schedule.num_stages - 1
    out = []
    for a in schedule.actions[rank]:
        key = dst = None
        if a.kind == FORWARD and a.stage < last_stage:
            dst = schedule.placement[(a.pipe, a.stage + 1)]
            key = ("act", a.mb, a.stage, a.pipe)
        elif a.kind in INPUT_GRAD_KINDS and a.stage > 0:
            dst = schedule.placement[(a.pipe, a.stage - 1)]
            key = ("grad", a.mb, a.stage, a.pipe)
        out.append((key, dst if dst != rank else None))
    return out


def needed_key(schedule: Schedule, a) -> tuple | None:
    """The transfer key an action consumes (activation or output gradient), if any."""
    if a.kind == FORWARD and a.stage > 0:
        return ("act", a.mb, a.stage - 1, a.pipe)
    if a.kind in INPUT_GRAD_KINDS and a.stage < schedule.num_stages - 1:
        return ("grad", a.mb, a.stage + 1, a.pipe)
    return None


class Executor:
    """Runs ``schedule`` for the rank at index ``pp_rank`` of the pp group.

    ``m`` is the number of micro-batches of one step. With ``bounds`` (``bounds[t][r] =
    (lo, hi)``, from ``parbench.schedules.step_bounds``) the schedule is a whole continuous
    run and step t runs ``actions[r][lo:hi]``, its micro-batches numbered in the run.
    """

    def __init__(self, *, schedule: Schedule, pp_rank: int, group, group_ranks: list[int],
                 slots: dict[tuple[int, int], StageSlot], act_shape, dtype, device, timeline,
                 weights: WeightRule, m: int, bounds: list | None = None):
        self.schedule = schedule
        self.pp_rank = pp_rank
        self.group = group
        self.global_ranks = list(group_ranks)
        self.slots = slots
        self.act_shape = tuple(act_shape)
        self.dtype = dtype
        self.device = device
        self.timeline = timeline
        self.weights = weights
        self.m = m
        self.bounds = bounds
        self.sync_cuda = device.type == "cuda"
        # gloo moves a message only once its receive is posted, so on CPU the receives of
        # the next action are posted one action early and the transfer overlaps compute.
        # NCCL waits do not block the host, and an early receive would sit in front of
        # later sends on the communicator's stream, so there each receive is posted just
        # in time (batched with the pending send).
        self.lookahead = 1 if device.type == "cpu" else 0
        self.row = schedule.actions[pp_rank]
        self.sends = _produced(schedule, pp_rank)
        # receive queues: per source rank, keys addressed to me in the source's order
        self.recv_order: dict[int, list[tuple]] = {}
        self.recv_src: dict[tuple, int] = {}
        for src in range(schedule.p):
            if src == pp_rank:
                continue
            keys = [k for k, d in _produced(schedule, src) if d == pp_rank]
            if keys:
                self.recv_order[src] = keys
                for k in keys:
                    self.recv_src[k] = src
        self.activations = HeldActivations()
        self.track = True
        self._loss_sum = 0.0
        self._reset()

    def _reset(self) -> None:
        """Nothing in flight (the start of a run, or of every step of a flushing schedule)."""
        self._local: dict = {}
        self._recv_buf: dict = {}
        self._recv_work: dict = {}
        self._send_works: list = []
        self._coalesced: list = []
        self._next_recv = {src: 0 for src in self.recv_order}
        # per (mb, stage, pipe): what the forward saved for the backward (and B for W)
        self.saved: dict[tuple, dict] = {}

    # ---- point-to-point ----------------------------------------------------------------
    def _post(self, ops: list) -> None:
        """Post a batch; remember the work that completes each received key."""
        if not ops:
            return
        works = dist.batch_isend_irecv([op for op, _ in ops])
        per_op = len(works) == len(ops)
        for i, (op, key) in enumerate(ops):
            if key is None:  # a send: keep the tensor alive until it is waited for
                self._send_works.append((works[i] if per_op else None, op.tensor))
            else:
                self._recv_work[key] = [works[i]] if per_op else list(works)
        if not per_op:
            self._send_works.append((None, None))
            self._coalesced.extend(works)

    def _recv_ops(self, key) -> list:
        """Receive ops for ``key`` and every earlier message from the same sender."""
        if key is None or key not in self.recv_src or key in self._recv_buf:
            return []  # nothing to receive, a local hand-off, or already posted
        src = self.recv_src[key]
        queue = self.recv_order[src]
        ops = []
        while self._next_recv[src] < len(queue):
            k = queue[self._next_recv[src]]
            self._next_recv[src] += 1
            buf = torch.empty(self.recv_shape(k), dtype=self.dtype, device=self.device)
            self._recv_buf[k] = buf
            ops.append((dist.P2POp(dist.irecv, buf, self.global_ranks[src], self.group), k))
            if k == key:
                break
        return ops

    def recv_shape(self, key) -> tuple:
        """The shape of the message ``key`` (token-slice pipelines: the slice's length)."""
        return self.act_shape

    def _take(self, key) -> torch.Tensor | None:
        if key is None:
            return None
        if key in self._local:
            return self._local.pop(key)
        for w in self._recv_work.pop(key):
            w.wait()
        return self._recv_buf.pop(key)

    def _finish_sends(self, drain: bool) -> None:
        """At the end of a step: wait for every send (``drain``), or keep only the works of
        the sends not yet matched -- their tensors stay referenced by the works -- so that a
        continuous pipeline carries them into the next step without blocking."""
        if drain:
            for w, _ in self._send_works:
                if w is not None:
                    w.wait()
            for w in self._coalesced:
                w.wait()
            self._send_works, self._coalesced = [], []
            return
        self._send_works = [(w, None) for w, _ in self._send_works
                            if w is not None and not w.is_completed()]
        self._coalesced = [w for w in self._coalesced if not w.is_completed()]

    # ---- the actions ---------------------------------------------------------------------
    def _forward(self, slot: StageSlot, a, received, x, y):
        """F: run the stage on the rule's weights; returns what it sends (None: the loss)."""
        weights = self.weights
        inp = x if slot.module.first else received.requires_grad_(True)
        param_dict = weights.forward_params(slot, a.mb)
        params = slot.params if param_dict is None else list(param_dict.values())
        key = (a.mb, a.stage, a.pipe)
        if self.track:
            with self.activations.forward([*params, x, y]):
                boundary, out = stage_forward(slot.module, inp, y, param_dict)
        else:
            boundary, out = stage_forward(slot.module, inp, y, param_dict)
        if slot.module.last:
            self._loss_sum += float(out.detach())
            out = out / weights.loss_divisor(self.m)
        self.saved[key] = {"boundary": boundary, "out": out, "params": params}
        return None if slot.module.last else out.detach()

    def _fused(self, slot: StageSlot, a, saved: dict, grad_out):
        """The whole backward of one (micro-batch, stage); returns the input gradient."""
        boundary = saved["boundary"] if a.stage > 0 else None
        if self.weights.accumulates_in_grad:
            return fused_backward_into_grad(saved["out"], boundary, saved["params"], grad_out)
        dx, grads = fused_grads(saved["out"], boundary, saved["params"], grad_out)
        self.weights.on_grads(slot, a.mb, saved["params"], grads)
        return dx

    def _backward_full(self, slot: StageSlot, a, received):
        """BW: input and weight gradients in one pass; the graph is freed."""
        return self._fused(slot, a, self.saved.pop((a.mb, a.stage, a.pipe)), received)

    def _backward_input(self, slot: StageSlot, a, received):
        """B: the input gradient now; the graph is kept for W."""
        saved = self.saved[(a.mb, a.stage, a.pipe)]
        if a.stage == 0:
            # nothing waits for the first stage's input gradient (its input is tokens): B
            # only keeps the output gradient, W runs the stage's whole backward in one pass
            # (torch.distributed.pipelining does the same)
            saved["grad_out"] = received
            return None
        split = SplitBackward(saved["out"], saved["boundary"], saved["params"])
        produced = split.input_grad(received)
        saved.clear()
        saved["split"], saved["params"] = split, split.params
        return produced

    def _backward_weight(self, slot: StageSlot, a) -> None:
        """W: the weight gradients from the graph B kept; the graph is freed."""
        saved = self.saved.pop((a.mb, a.stage, a.pipe))
        if "split" in saved:
            grads = saved["split"].weight_grads()
            self.weights.on_grads(slot, a.mb, saved["params"], grads)
        else:
            self._fused(slot, a, saved, saved["grad_out"])

    # ---- extension points (no-ops here; BPipe's executor moves activations in them) ------
    def _before_action(self, k: int, a) -> None:
        """At position ``k``, once the action's receives are posted, before its input."""

    def _after_action(self, k: int, a) -> None:
        """After the action at position ``k`` (its output send queued, not yet posted)."""

    def _after_row(self, hi: int) -> None:
        """After the step's last action and the last send posted, before sends drain."""

    # ---- one step ----------------------------------------------------------------------
    def run(self, xs: list[torch.Tensor], ys: list[torch.Tensor], step: int = 0,
            track: bool = True) -> StepOutcome:
        """Run this rank's actions of one step; returns the mean micro-batch loss (last
        stages only). ``xs``/``ys``: the step's m micro-batches; ``track``: measure the
        saved activations (``activations``)."""
        continuous = self.bounds is not None
        if continuous:
            lo, hi = self.bounds[step][self.pp_rank]
            first_mb, drain = step * self.m, step == len(self.bounds) - 1
            if step == 0:
                self._reset()
        else:
            lo, hi, first_mb, drain = 0, len(self.row), 0, True
            self._reset()
        self.track = track
        self.activations.reset_peaks()
        self._loss_sum = 0.0
        schedule, timeline = self.schedule, self.timeline
        pending: list = []
        for k in range(lo, hi):
            a, (out_key, dst) = self.row[k], self.sends[k]
            need = needed_key(schedule, a)
            ops = pending + self._recv_ops(need)
            for nxt in self.row[k + 1:min(k + 1 + self.lookahead, hi)]:
                ops += self._recv_ops(needed_key(schedule, nxt))
            pending = []
            self._post(ops)
            self._before_action(k, a)
            received = self._take(need)
            slot = self.slots[(a.pipe, a.stage)]
            with timeline.span(a.kind, mb=a.mb, stage=a.stage, pipe=a.pipe):
                if a.kind == FORWARD:
                    i = a.mb - first_mb
                    produced = self._forward(slot, a, received, xs[i], ys[i])
                elif a.kind == BACKWARD_FULL:
                    produced = self._backward_full(slot, a, received)
                elif a.kind == BACKWARD_INPUT:
                    produced = self._backward_input(slot, a, received)
                else:  # BACKWARD_WEIGHT
                    self._backward_weight(slot, a)
                    produced = None
                if self.sync_cuda:
                    torch.cuda.synchronize(self.device)
            received = None
            if out_key is not None:
                tensor = produced.detach()
                if dst is None:
                    self._local[out_key] = tensor
                else:
                    tensor = tensor.contiguous()
                    pending.append((dist.P2POp(dist.isend, tensor, self.global_ranks[dst],
                                               self.group), None))
            produced = None
            self._after_action(k, a)
        self._post(pending)
        self._after_row(hi)
        self._finish_sends(drain)
        if drain:
            leftover = list(self._recv_buf)
            if self.saved or leftover or self._local:
                raise RuntimeError(f"pipeline executor: rank {self.pp_rank} ended the step "
                                   f"with unfinished work: {sorted(self.saved)[:4]} "
                                   f"{leftover[:4]} {sorted(self._local)[:4]}")
        return StepOutcome(loss=self._loss_sum / self.m)

    @property
    def peak_held(self) -> int:
        """Most micro-batches whose saved activations were alive at once in the last tracked
        step (carried micro-batches included)."""
        return self.activations.peak_held

    @property
    def peak_activation_bytes(self) -> int:
        return self.activations.peak_bytes
