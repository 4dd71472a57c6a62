"""The one pipeline executor: runs any `parbench.schedules.Schedule` on real ranks.

Each rank walks its own *lowered* list in order (``parbench.schedules.lower``: the compute
actions with the sends and receives their cross-rank dependencies imply, inserted where the
lowering's rules say) and dispatches every entry; it does not decide where a transfer goes:

* a run of consecutive p2p entries is posted as one ``batch_isend_irecv``; a compute action
  waits for the receive of its input (if any) when it starts; sends are waited for at the
  end of the step -- of the run, for a continuous pipeline (PipeDream, 2BW:
  ``parbench.schedules.continuous``), whose rows span the whole run and are executed one
  step's slice at a time (the lowering never posts a receive ahead across a step's cut):
  the micro-batches in flight, the receives posted and the sends not yet matched carry
  over to the next step (the harness's barrier between steps is on another group, so a
  pending send on the pp group does not block it), and the last step drains;
* on CPU the lowering posts the receives of the next action one action early (gloo moves
  a message once its receive is posted, so the transfer overlaps compute); on CUDA just in
  time (``lower``'s ``lookahead``);
* a transfer between two stages on the same rank is a local hand-off (no entry, no traffic).

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

from parbench.model import counted_tokens, documents_of
from parbench.schedules import Schedule
from parbench.schedules.actions import (
    BACKWARD_FULL,
    BACKWARD_INPUT,
    FORWARD,
    P2P_KINDS,
    SEND_B,
    SEND_F,
)
from parbench.schedules.lower import lower_rank, needed, peer_of, produced, transfer_key

from .activations import HeldActivations
from .split_backward import SplitBackward, fused_backward_into_grad, fused_grads
from .weights import StageSlot, WeightRule


@dataclass(frozen=True)
class StepOutcome:
    """What one step of the executor returns on one rank."""

    #: mean over the m micro-batches of the loss of this rank's last stages (0 elsewhere)
    loss: float


def stage_forward(module, inp, targets, param_dict=None, docs=None):
    """Forward of one stage: returns (boundary, output).

    The boundary is the tensor B differentiates with respect to: the received input (None on
    the first stage, whose input is tokens). With ``param_dict`` (a stashed weight version,
    PipeDream) the stage runs on those tensors through ``functional_call``; ``docs``: the
    micro-batch's packed documents (``parbench.model.packing``), which every stage attends
    within, found in the micro-batch's tokens that every rank holds.
    """
    # an unpacked step passes two arguments: the hybrid family's stage modules take two
    args = (inp, targets) if docs is None else (inp, targets, docs)
    if param_dict is not None:
        out = functional_call(module, param_dict, args)
    else:
        out = module(*args)
    return (None if module.first else inp), out


def _keys(schedule: Schedule, a) -> tuple[tuple | None, tuple | None]:
    """(the message ``a`` consumes, the message it produces): ``transfer_key`` form, None
    where it has none."""
    need, out = needed(schedule, a), produced(schedule, a)
    return (None if need is None else transfer_key(need[0]),
            None if out is None else transfer_key(out[0]))


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
        self.global_tokens: int | None = None  # set per step under a loss mask
        self.sync_cuda = device.type == "cuda"
        # gloo moves a message only once its receive is posted, so on CPU the receives of
        # the next action are posted one action early; on NCCL an early receive would sit
        # in front of later sends on the communicator's stream (``lower``'s lookahead)
        self.lookahead = 1 if device.type == "cpu" else 0
        cuts = [b[pp_rank][0] for b in bounds] if bounds is not None else ()
        self.row, self.starts = lower_rank(schedule, pp_rank, self.lookahead, cuts)
        self.keys = [_keys(schedule, a) for a in schedule.actions[pp_rank]]
        self.activations = HeldActivations()
        self.track = True
        self._loss_sum = 0.0
        self._reset()

    def _reset(self) -> None:
        """Nothing in flight (the start of a run, or of every step of a flushing schedule)."""
        self._ready: dict = {}  # produced, not yet sent or handed over locally
        self._recv_buf: dict = {}
        self._recv_work: dict = {}
        self._send_works: list = []
        self._coalesced: list = []
        # per (mb, stage, pipe): what the forward saved for the backward (and B for W)
        self.saved: dict[tuple, dict] = {}

    # ---- point-to-point ----------------------------------------------------------------
    def _op(self, entry) -> tuple:
        """The ``P2POp`` of one lowered p2p entry, and the key it receives (None: a send)."""
        key = transfer_key(entry)
        peer = self.global_ranks[peer_of(self.schedule, entry)]
        if entry.kind == SEND_F or entry.kind == SEND_B:
            tensor = self._ready.pop(key).contiguous()
            return dist.P2POp(dist.isend, tensor, peer, self.group), None
        buf = torch.empty(self.recv_shape(key), dtype=self.dtype, device=self.device)
        self._recv_buf[key] = buf
        return dist.P2POp(dist.irecv, buf, peer, self.group), key

    def _post(self, batch: list) -> None:
        """Post a batch of lowered p2p entries; remember the work completing each receive."""
        if not batch:
            return
        ops = [self._op(entry) for entry in batch]
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

    def recv_shape(self, key) -> tuple:
        """The shape of the message ``key`` (token-slice pipelines: the slice's length)."""
        return self.act_shape

    def _take(self, key) -> torch.Tensor | None:
        if key is None:
            return None
        if key in self._ready:  # a local hand-off
            return self._ready.pop(key)
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
        docs = self.documents(slot, x)
        if self.track:
            with self.activations.forward([*params, x, y]):
                boundary, out = stage_forward(slot.module, inp, y, param_dict, docs)
        else:
            boundary, out = stage_forward(slot.module, inp, y, param_dict, docs)
        if slot.module.last:
            scale = self.loss_scale(a.mb, y)
            # summed unscaled over the micro-batches (the step reports the sum / m; the
            # token-slice executors add their slices' losses the same way); masked: each
            # micro-batch weighted by its share of the counted tokens, times m
            weight = 1.0 if self.global_tokens is None else scale * self.m
            self._loss_sum += float(out.detach()) * weight
            out = out * scale
        self.saved[key] = {"boundary": boundary, "out": out, "params": params}
        return None if slot.module.last else out.detach()

    def loss_scale(self, mb: int, y: torch.Tensor) -> float:
        """What micro-batch ``mb``'s mean token loss is multiplied by before its backward:
        1/loss_divisor(m), or with a loss mask (``global_tokens`` set) n_mb / N (n_mb: its
        counted tokens, N: the global batch's) -- Megatron-LM's --calculate-per-token-loss."""
        if self.global_tokens is None:
            return 1.0 / self.weights.loss_divisor(self.m)
        return counted_tokens(y) / self.global_tokens

    def documents(self, slot: StageSlot, tokens: torch.Tensor):
        """The packed documents of the micro-batch ``tokens`` (None: an unpacked model)."""
        return documents_of(slot.module.cfg, tokens)

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
            lo, hi, first_mb, drain = 0, len(self.keys), 0, True
            self._reset()
        self.track = track
        self.activations.reset_peaks()
        self._loss_sum = 0.0
        batch: list = []
        k = lo
        for entry in self.row[self.starts[lo]:self.starts[hi]]:
            if entry.kind in P2P_KINDS:
                batch.append(entry)
                continue
            self._post(batch)
            batch = []
            self._compute(k, entry, xs, ys, first_mb)
            k += 1
        self._post(batch)
        self._after_row(hi)
        self._finish_sends(drain)
        if drain and (self.saved or self._recv_buf or self._ready):
            raise RuntimeError(f"pipeline executor: rank {self.pp_rank} ended the step with "
                               f"unfinished work: {sorted(self.saved)[:4]} "
                               f"{list(self._recv_buf)[:4]} {sorted(self._ready)[:4]}")
        return StepOutcome(loss=self._loss_sum / self.m)

    def _compute(self, k: int, a, xs, ys, first_mb: int) -> None:
        """The compute action at position ``k`` of the rank's row: its input (received or
        handed over), the action, its output kept for its send or its local consumer."""
        in_key, out_key = self.keys[k]
        self._before_action(k, a)
        received = self._take(in_key)
        slot = self.slots[(a.pipe, a.stage)]
        with self.timeline.span(str(a.kind), mb=a.mb, stage=a.stage, pipe=a.pipe):
            if a.kind == FORWARD:
                i = a.mb - first_mb
                out = self._forward(slot, a, received, xs[i], ys[i])
            elif a.kind == BACKWARD_FULL:
                out = self._backward_full(slot, a, received)
            elif a.kind == BACKWARD_INPUT:
                out = self._backward_input(slot, a, received)
            else:  # BACKWARD_WEIGHT
                self._backward_weight(slot, a)
                out = None
            if self.sync_cuda:
                torch.cuda.synchronize(self.device)
        received = None
        if out_key is not None:
            self._ready[out_key] = out.detach()
        out = None
        self._after_action(k, a)

    @property
    def peak_held(self) -> int:
        """Most micro-batches whose saved activations were alive at once in the last tracked
        step (carried micro-batches included)."""
        return self.activations.peak_held

    @property
    def peak_activation_bytes(self) -> int:
        return self.activations.peak_bytes
