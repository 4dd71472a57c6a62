"""Asynchronous pipelines: PipeDream (weight stashing) and PipeDream-2BW (double buffering).

Neither equals single-device SGD; each is checked against a single-device run of its own
update rule (``reference``). The harness puts a barrier around every ``train_step``, so
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

import torch
from torch.func import functional_call

from parbench.golden import GoldenRun, global_batch
from parbench.model import build_model, build_stage, make_optimizer

from .common import microbatches, optimizer_tensors
from .pipeline_scheme import PipelineScheme


def _snapshot(named) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone().requires_grad_(True) for n, p in named}


def _stage_delay(p: int, stage: int) -> int:
    """Updates a stage is behind the micro-batch entering the pipeline (1F1B warm-up)."""
    return p - 1 - stage


# ---- PipeDream ------------------------------------------------------------------------


class PipeDreamWeights:
    """Per-stage optimizer updated after every backward; stashed versions for forwards."""

    def __init__(self, slots, run_cfg, p: int, m: int):
        self.slots, self.p, self.m = slots, p, m
        self.opts = {id(s): make_optimizer(s.params, run_cfg) for s in slots}
        self.versions = {id(s): {0: _snapshot(zip(s.names, s.params))} for s in slots}
        self.updates = {id(s): 0 for s in slots}
        self.first_mb = 0  # global index of this step's micro-batch 0
        self.grad_mean = {id(s): [torch.zeros_like(p) for p in s.params] for s in slots}

    def loss_divisor(self, m: int) -> int:
        return 1  # every micro-batch is a minibatch of its own

    def step_begin(self, slots) -> None:
        for s in slots:
            for g in self.grad_mean[id(s)]:
                g.zero_()

    def _version(self, slot, g_index: int) -> int:
        return max(0, g_index - _stage_delay(self.p, slot.stage))

    def forward_params(self, slot, mb: int):
        v = self._version(slot, self.first_mb + mb)
        versions = self.versions[id(slot)]
        if v not in versions:
            raise RuntimeError(f"pipedream: stage {slot.stage} has no weight version {v} "
                               f"(kept {sorted(versions)})")
        for old in [k for k in versions if k < v]:
            del versions[old]
        return versions[v]

    def on_grads(self, slot, mb: int, params, grads) -> None:
        for p, g, acc in zip(slot.params, grads, self.grad_mean[id(slot)]):
            p.grad = g
            acc.add_(g / self.m)
        self.opts[id(slot)].step()
        self.updates[id(slot)] += 1
        self.versions[id(slot)][self.updates[id(slot)]] = _snapshot(zip(slot.names,
                                                                        slot.params))

    def step_end(self) -> None:
        self.first_mb += self.m
        for s in self.slots:  # keep what the next step's warm-up forwards need
            keep = self._version(s, self.first_mb)
            versions = self.versions[id(s)]
            for old in [k for k in versions if k < keep]:
                del versions[old]

    def reported_grads(self, slot):
        return self.grad_mean[id(slot)]

    def state_tensors(self) -> dict:
        params = [p for s in self.slots for p in s.params]
        return {"params": params, "grads": [p.grad for p in params if p.grad is not None],
                "optimizer": [t for o in self.opts.values() for t in optimizer_tensors(o)],
                "stash": [t for s in self.slots for d in self.versions[id(s)].values()
                          for t in d.values()]}


class PipeDreamScheme(PipelineScheme):
    """PipeDream: asynchronous 1F1B with weight stashing (see module docstring)."""

    def _make_weights(self):
        return PipeDreamWeights(list(self.slots.values()), self.ctx.run, self.schedule.p,
                                self.schedule.m)

    def full_grads(self):
        return {n: g for s in self.slots.values()
                for n, g in zip(s.names, self.weights.reported_grads(s))}

    @staticmethod
    def extra_state_bytes(case, schedule, rank, counts) -> dict:
        (_, stage), = schedule.stages_of(rank)
        kept = min(_stage_delay(schedule.p, stage), case.run.steps * schedule.m) + 1
        return {"stash": 4 * counts[stage][0] * kept}

    @classmethod
    def reference(cls, case, steps):
        return pipedream_reference(case, steps)


def pipedream_reference(case, steps: int) -> GoldenRun:
    """Single device, same rule: stage s of micro-batch G runs on version G-(p-1-s)."""
    cfg, run = case.model, case.run
    p, m = case.parallel.pp, case.parallel.num_microbatches
    stages = [build_stage(cfg, run.seed, s, p) for s in range(p)]
    opts = [make_optimizer(st.parameters(), run) for st in stages]
    history = [{0: _snapshot(st.named_parameters())} for st in stages]
    out, g_index = GoldenRun(), 0
    for step in range(steps):
        x, y = global_batch(case, step)
        grad_mean = {n: torch.zeros_like(t) for st in stages for n, t in st.named_parameters()}
        losses = []
        for xm, ym in microbatches(x, y, m):
            used = [history[s][max(0, g_index - _stage_delay(p, s))] for s in range(p)]
            h = xm
            for s, st in enumerate(stages):
                h = functional_call(st, used[s], (h, ym))
            tensors = [t for d in used for t in d.values()]
            grads = torch.autograd.grad(h, tensors)
            losses.append(float(h.detach()))
            it = iter(grads)
            for s, st in enumerate(stages):
                for (n, prm), g in zip(st.named_parameters(), it):
                    prm.grad = g
                    grad_mean[n].add_(g / m)
                opts[s].step()
                history[s][g_index + 1] = _snapshot(st.named_parameters())
            g_index += 1
        out.losses.append(sum(losses) / m)
        out.grads.append(grad_mean)
        out.params.append({n: t.detach().clone() for st in stages
                           for n, t in st.named_parameters()})
    return out


# ---- PipeDream-2BW --------------------------------------------------------------------


class TwoBWWeights:
    """Shadow W(t-1) in the stage modules (computes), master W(t) in the optimizer."""

    accumulates_in_grad = True  # gradients of the shadow accumulate in its .grad

    def __init__(self, slots, run_cfg):
        self.slots = slots
        self.master = {id(s): [torch.nn.Parameter(p.detach().clone()) for p in s.params]
                       for s in slots}
        self.opt = make_optimizer([t for v in self.master.values() for t in v], run_cfg)

    def loss_divisor(self, m: int) -> int:
        return m

    def forward_params(self, slot, mb):
        return None

    def step_begin(self, slots) -> None:
        for s in slots:
            for p in s.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                else:
                    p.grad.zero_()

    def on_grads(self, slot, mb, params, grads) -> None:
        for p, g in zip(params, grads):
            if g is not None:
                p.grad.add_(g)

    def step_end(self) -> None:
        older = {k: [t.detach().clone() for t in v] for k, v in self.master.items()}
        for s in self.slots:
            for mp, p in zip(self.master[id(s)], s.params):
                mp.grad = p.grad.detach().clone()
        self.opt.step()  # W(t+1) = W(t) - lr * grad f(W(t-1))
        with torch.no_grad():
            for s in self.slots:  # the shadow becomes W(t)
                for p, w in zip(s.params, older[id(s)]):
                    p.copy_(w)
        for v in self.master.values():
            for mp in v:
                mp.grad = None

    def state_tensors(self) -> dict:
        params = [p for s in self.slots for p in s.params]
        return {"params": [t for v in self.master.values() for t in v],
                "grads": [p.grad for p in params if p.grad is not None],
                "optimizer": optimizer_tensors(self.opt), "stash": params}


class TwoBWScheme(PipelineScheme):
    """PipeDream-2BW: 1F1B order, double-buffered weights (see module docstring)."""

    def _make_weights(self):
        return TwoBWWeights(list(self.slots.values()), self.ctx.run)

    def full_params(self):
        return {n: t.detach() for s in self.slots.values()
                for n, t in zip(s.names, self.weights.master[id(s)])}

    @staticmethod
    def extra_state_bytes(case, schedule, rank, counts) -> dict:
        return {"stash": sum(4 * counts[s][0] for _, s in schedule.stages_of(rank))}

    @classmethod
    def reference(cls, case, steps):
        return two_bw_reference(case, steps)


def two_bw_reference(case, steps: int) -> GoldenRun:
    """Single device: loss and gradient of batch t at W(t-1); AdamW step on W(t)."""
    cfg, run = case.model, case.run
    model = build_model(cfg, run.seed)
    opt = make_optimizer(model.parameters(), run)
    shadow = _snapshot(model.named_parameters())
    out = GoldenRun()
    for step in range(steps):
        x, y = global_batch(case, step)
        loss = functional_call(model, shadow, (x, y))
        grads = torch.autograd.grad(loss, list(shadow.values()))
        older = _snapshot(model.named_parameters())
        for prm, g in zip(model.parameters(), grads):
            prm.grad = g
        opt.step()
        shadow = older
        out.losses.append(float(loss.detach()))
        out.grads.append({n: g.detach().clone() for n, g in zip(shadow, grads)})
        out.params.append({n: t.detach().clone() for n, t in model.named_parameters()})
    return out
