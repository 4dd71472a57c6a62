"""Asynchronous pipelines: PipeDream (weight stashing) and PipeDream-2BW (double buffering),
run as the papers run them -- continuously, without a flush between steps.

Neither equals single-device SGD; each is checked against a single-device run of its own
update rule (``references``), with the per-step state the continuous pipeline has. The
weight rules are in ``async_weights``; the run's 1F1B order and its cut into harness steps
in ``parbench.schedules.continuous``: step t runs the forwards of its own m micro-batches
(global index g = t m + i) and the backwards lagging them by the warm-up p-1-s of stage s,
so the p-1-s micro-batches in flight at the end of a step complete in the next one, and
the last step of the run (``steps + timed_steps``) drains.

**PipeDream** (Narayanan et al. 2019, "PipeDream: Generalized Pipeline Parallelism for DNN
Training", SOSP, Sec. 3.3; rule as written in Narayanan et al. 2021, "Memory-Efficient
Pipeline-Parallel DNN Training", ICML, Sec. 2). Every micro-batch is a PipeDream minibatch:
each stage updates its weights after every backward, with that micro-batch's own mean-loss
gradient (no 1/m scaling, no accumulation). Micro-batch g reaches stage s when the stage has
done ``g - (p-1-s)`` updates, so it runs on version ``max(0, g - (p-1-s))``, which weight
stashing keeps for its backward: W_s(g+1) = opt(W_s(g), grad_s f_g(W_0(v_0(g)), ...,
W_{p-1}(v_{p-1}(g)))), i.e. W(t+1) = W(t) - lr grad f(W_1(t-p+1), ..., W_p(t)). Stage s keeps
p-s versions. After harness step t, stage s has applied the updates of the micro-batches
whose backward it completed: (t+1) m - (p-1-s) (all of them after the drain); it reports
those parameters and the gradient of its latest update.

**PipeDream-2BW** (Narayanan et al. 2021, Sec. 3.1): gradients are accumulated over the m
micro-batches of a batch (loss scaled by 1/m, as in the synchronous schedules) and computed
on the weights one step old, W(t+1) = W(t) - lr * grad f(W(t-1)) with W(-1) = W(0); the
optimizer (AdamW here) plays the role of the plain ``- lr * grad``. Two versions per stage.
Stage s applies batch t's update after its last backward of the batch -- at the end of step t
on the last stage, during step t+1 elsewhere. After step t the last stage reports W(t+1)
and the full gradient of batch t; stage s < p-1 reports W(t) and its gradient buffer, which
holds batch t's first m - (p-1-s) micro-batches (after the drain: W(T), the full gradient).

A stage applies a number of optimizer steps per harness step that is not one (none in the
first step of stage 0 of 2BW, m for PipeDream, more in the drain), so the verdict's update
check does not apply: the reference run checks the rule.

**Requirements** (checked before spawning): m >= p, so that every stage completes a backward
in the first step, 2BW's batch t+1 cannot reach a stage before batch t-1 has left it, and
the in-flight micro-batches and weight versions are the same after every step; timed_steps
>= 1, so that the drain falls outside the checked steps (the harness compares every checked
step with one set of model states); no gradient clipping (``clip_grad`` 0: each stage steps
on its own schedule, so no rank ever holds one update's global norm).
"""
from __future__ import annotations

from parbench.config import CaseConfig, ConfigError
from parbench.schedules import (
    continuous_schedule,
    get_spec,
    relabel,
    steady_step,
    step_bounds,
)

from .async_weights import PipeDreamWeights, TwoBWWeights
from .prediction import async_prediction
from .references import pipedream_reference, two_bw_reference
from .scheme import PipelineScheme


class ContinuousScheme(PipelineScheme):
    """A pipeline run without flushes: one 1F1B schedule over the whole run."""

    checks_update = False
    #: no clipping by global norm: a stage applies an update when its own backwards of a
    #: (micro-)batch are done -- PipeDream after every micro-batch, 2BW's stage s a step after
    #: the last stage -- so the norm of one update's whole gradient exists on no rank at any
    #: moment without a pp-wide wait the asynchronous pipeline is built to avoid, and the
    #: references of their rules (``references``) do not clip; ``clip_grad`` > 0 is refused
    supports_clip_grad = False
    supports_loss_mask = False  # not yet: per-micro-batch token scaling only in sync
    supports_packing = False  # their references chain stages without documents

    def executed_schedule(self):
        run = self.ctx.run
        total = run.steps + run.timed_steps
        rows = continuous_schedule(self.schedule_name, self.schedule.p, self.m, total)
        return rows, step_bounds(rows, self.m, total)

    @classmethod
    def step_schedule(cls, case):
        """One steady step (a window of the run: ``parbench.schedules.steady_step``)."""
        return steady_step(cls.schedule_name, case.layout.pp, case.layout.num_microbatches)

    def measured_schedule(self):
        return self.step_schedule(self.ctx.case)

    def measured_events(self, events, step):
        """Steady steps only (not the first, not the draining last), relabelled to
        ``steady_step``'s micro-batches."""
        run = self.ctx.run
        if step == 0 or step >= run.steps + run.timed_steps - 1:
            return None
        return [dict(e, mb=relabel(e["mb"], step, self.m)) for e in events
                if e["cat"] == "compute"]

    @classmethod
    def check(cls, case: CaseConfig) -> None:
        super().check(case)
        par = case.layout
        if par.num_microbatches < par.pp:
            raise ConfigError(f"num_microbatches={par.num_microbatches}: {cls.name} runs "
                              f"continuously and needs m >= pp={par.pp} (every stage "
                              "completes a backward in every step)")

    @classmethod
    def predict(cls, case: CaseConfig):
        return async_prediction(case, cls.schedule_name, get_spec(cls.schedule_name).weight_rule)


class PipeDreamScheme(ContinuousScheme):
    """PipeDream: asynchronous 1F1B with weight stashing (see module docstring)."""

    def make_weights(self):
        return PipeDreamWeights(list(self.slots.values()), self.ctx.run, p=self.schedule.p,
                                m=self.m)

    @classmethod
    def reference(cls, case, steps):
        return pipedream_reference(case, steps)


class TwoBWScheme(ContinuousScheme):
    """PipeDream-2BW: 1F1B order, double-buffered weights (see module docstring)."""

    def make_weights(self):
        return TwoBWWeights(list(self.slots.values()), self.ctx.run, p=self.schedule.p,
                            m=self.m)

    @classmethod
    def reference(cls, case, steps):
        return two_bw_reference(case, steps)
