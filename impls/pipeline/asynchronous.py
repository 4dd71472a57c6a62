"""Asynchronous pipelines: PipeDream (weight stashing) and PipeDream-2BW (double buffering).

Neither equals single-device SGD; each is checked against a single-device run of its own
update rule (``references``). The weight rules are in ``async_weights``. The harness puts a barrier around every ``train_step``, so
the pipeline drains at step boundaries; the weight semantics below are nevertheless those of
the continuous (no-flush) pipeline in steady state, which is what the papers define.

**PipeDream** (Narayanan et al. 2019, "PipeDream: Generalized Pipeline Parallelism for DNN
Training", SOSP, Sec. 3.3; rule as written in Narayanan et al. 2021, "Memory-Efficient
Pipeline-Parallel DNN Training", ICML, Sec. 2). Every micro-batch is a PipeDream minibatch:
each stage updates its weights after every backward, with that micro-batch's own mean-loss
gradient (no 1/m scaling, no accumulation). In 1F1B steady state stage s (of p) has done
``G - (p-1-s)`` updates when the forward of global micro-batch G (= step*m + i) reaches it,
so micro-batch G runs stage s on weight version ``max(0, G - (p-1-s))``; weight stashing
keeps that version for its backward. The update is
``W_s(G+1) = opt(W_s(G), grad_s f_G(W_0(v_0(G)), ..., W_{p-1}(v_{p-1}(G))))``, i.e.
W(t+1) = W(t) - lr * grad f(W_1(t-p+1), ..., W_p(t)). Stage s stashes p-s versions.
One harness *step* = m such updates per stage; the reported loss is the mean of the m
micro-batch losses, the reported gradient the mean of the m gradients applied, the
parameters those after the m-th update.

**PipeDream-2BW** (Narayanan et al. 2021, Sec. 3.1): gradients are accumulated over the m
micro-batches of a batch (loss scaled by 1/m, as in the synchronous schedules) and computed
on the weights one step old, W(t+1) = W(t) - lr * grad f(W(t-1)) with W(-1) = W(0); the
optimizer (AdamW here) plays the role of the plain ``- lr * grad``. Two versions per stage:
the shadow W(t-1) the micro-batches run on, and the master W(t) the optimizer updates. One
harness *step* = one batch; reported gradient grad f(W(t-1)), parameters W(t+1).
"""
from __future__ import annotations

from .async_weights import PipeDreamWeights, TwoBWWeights, stage_delay
from .references import pipedream_reference, two_bw_reference
from .scheme import PipelineScheme


class PipeDreamScheme(PipelineScheme):
    """PipeDream: asynchronous 1F1B with weight stashing (see module docstring)."""

    #: m optimizer steps per harness step: its reference run checks the update rule
    checks_update = False

    def make_weights(self):
        return PipeDreamWeights(list(self.slots.values()), self.ctx.run, p=self.schedule.p,
                                m=self.schedule.m)

    @staticmethod
    def extra_state_bytes(case, schedule, rank, counts) -> dict:
        """The stashed weight versions (leaf tensors that require grad: params) and the mean
        of the m applied gradients that the step reports (other)."""
        (_, stage), = schedule.stages_of(rank)
        kept = min(stage_delay(schedule.p, stage), case.run.steps * schedule.m) + 1
        return {"params": 4 * counts[stage][0] * kept, "other": 4 * counts[stage][0]}

    @classmethod
    def reference(cls, case, steps):
        return pipedream_reference(case, steps)


class TwoBWScheme(PipelineScheme):
    """PipeDream-2BW: 1F1B order, double-buffered weights (see module docstring)."""

    def make_weights(self):
        return TwoBWWeights(list(self.slots.values()), self.ctx.run)

    @staticmethod
    def extra_state_bytes(case, schedule, rank, counts) -> dict:
        """The master copy W(t) beside the shadow W(t-1) in the stage modules (params)."""
        return {"params": sum(4 * counts[s][0] for _, s in schedule.stages_of(rank))}

    @classmethod
    def reference(cls, case, steps):
        return two_bw_reference(case, steps)
