"""Local SGD: workers step independently and average their parameters every H steps.

Each of the d data-parallel workers trains its own replica on its own slice of the global
batch with its own optimizer (AdamW here; its states stay local), and every
H = ``parallel.local_sgd_period`` steps the parameters are averaged with one all-reduce
(Stich 2019, "Local SGD Converges Fast and Communicates Little"; Lin et al. 2020, "Don't Use
Large Mini-Batches, Use Local SGD"). It is not equivalent to single-device training by design,
so its golden run (``reference``) is the single-device simulation of the same d workers:
d replicas, each stepped on its slice of the batch, averaged after steps s with
(s + 1) % H == 0.

What is compared, per worker: each rank reports its own worker's tensors under the names
``w{r}/<parameter>`` -- *grads* are the worker's local gradient of the step (the mean over its
m micro-batches, each loss scaled 1/m), *params* its parameters after the step (after the
averaging on a sync step); the loss is the mean of the workers' local losses. Every rank thus
checks its own replica against the simulation.

Traffic: one all-reduce of all fp32 parameters on a sync step, 2(d-1)/d * 4 Psi bytes per
rank, none on the others; ``predict`` gives the last checked step's figure (what the harness
measures) and the per-step list.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from parbench.analytic import data_parallel, shape_from
from parbench.batching import dp_slice, microbatches
from parbench.config import CaseConfig, ConfigError
from parbench.golden import GoldenRun, global_batch
from parbench.model import build_model, make_optimizer
from parbench.scheme import Prediction, register

from .base import DataParallelScheme


def is_sync_step(step: int, period: int) -> bool:
    return (step + 1) % period == 0


def _flat_params(model, device):
    params = list(model.parameters())
    flat = torch.zeros(sum(p.numel() for p in params), dtype=torch.float32, device=device)
    grads = torch.zeros_like(flat)
    o = 0
    for p in params:
        n = p.numel()
        flat[o:o + n].copy_(p.detach().reshape(-1))
        p.data = flat[o:o + n].view_as(p)
        p.grad = grads[o:o + n].view_as(p)
        o += n
    return params, flat, grads


def local_step(model, opt, grads, mbs) -> float:
    """One worker's step: m micro-batches, each loss scaled 1/m, then the optimizer."""
    grads.zero_()
    total = 0.0
    m = len(mbs)
    for xm, ym in mbs:
        loss = model(xm, ym) / m
        loss.backward()
        total += float(loss.detach())
    opt.step()
    return total


@register
class LocalSGD(DataParallelScheme):
    name = "data.local_sgd"
    family = "data"
    uses = ("dp",)
    options = ("local_sgd_period",)
    description = "local SGD: independent workers, parameters averaged every H steps"
    checks_update = False  # the update averages the workers on sync steps
    supports_loss_mask = False  # each worker's step is its own batch's mean

    @classmethod
    def check(cls, case: CaseConfig) -> None:
        super().check(case)
        if case.run.dtype != "fp32":
            raise ConfigError(f"dtype={case.run.dtype!r} is not supported by {cls.name} "
                              "(fp32 only)")

    def __init__(self, ctx):
        super().__init__(ctx)
        self.model = build_model(ctx.model, ctx.run.seed).to(ctx.device)
        self.params, self.flat, self.grads = _flat_params(self.model, ctx.device)
        self.names = [n for n, _ in self.model.named_parameters()]
        self.opt = make_optimizer(self.params, ctx.run)

    def train_step(self, inputs, targets, step):
        mbs = self.local_microbatches(inputs, targets)
        tl = self.ctx.timeline
        with tl.span("BW", mb=-1):
            total = local_step(self.model, self.opt, self.grads, mbs)
        if is_sync_step(step, self.ctx.options.data.local_sgd_period):
            with tl.span("average"):
                dist.all_reduce(self.flat, group=self.group)
                self.flat.div_(self.dp_size)
        return self.reduce_loss(total / self.dp_size, self.group)

    def full_params(self):
        return {f"w{self.dp_rank}/{n}": p.detach() for n, p in zip(self.names, self.params)}

    def full_grads(self):
        return {f"w{self.dp_rank}/{n}": p.grad.detach() for n, p in zip(self.names, self.params)}

    @classmethod
    def reference(cls, case: CaseConfig, steps: int) -> GoldenRun:
        key = (repr(case.model), case.layout.dp, case.layout.num_microbatches,
               case.layout.micro_batch_size, case.options.data.local_sgd_period,
               repr(case.run.seed), case.run.optimizer, case.run.lr, case.run.weight_decay,
               case.run.beta1, case.run.beta2, case.run.eps, steps)
        if key not in _CACHE:
            if len(_CACHE) > 8:
                _CACHE.clear()
            _CACHE[key] = simulate_workers(case, steps)
        return _CACHE[key]

    @classmethod
    def predict(cls, case: CaseConfig) -> Prediction:
        """All fp32 parameters all-reduced on sync steps only
        (``parbench.analytic.data_parallel.local_sgd``)."""
        shape, d = shape_from(case.model), case.layout.dp
        period = case.options.data.local_sgd_period
        pred = data_parallel.local_sgd(shape, d, case.run.optimizer)
        # every step, the timed ones included (issue 20: ``parbench.verdict.timed``)
        per_step = [data_parallel.local_sgd_wire(shape, d, period, s)
                    for s in range(case.run.steps + case.run.timed_steps)]
        last = per_step[case.run.steps - 1]
        out = Prediction.uniform(d, {"dp": last}, pred.states, **pred.figures,
                                 wire_bytes_per_sync={"dp": max(per_step + [0.0])})
        out.wire_bytes_by_step = [[{"dp": w} for _ in range(d)] for w in per_step]
        out.calls_by_step = [[{"dp": int(w > 0)} for _ in range(d)] for w in per_step]
        return out


_CACHE: dict = {}


def simulate_workers(case: CaseConfig, steps: int) -> GoldenRun:
    """Single-device simulation of the d local-SGD workers (the golden run)."""
    d, m = case.layout.dp, case.layout.num_microbatches
    workers = []
    for _ in range(d):
        model = build_model(case.model, case.run.seed)
        params, flat, grads = _flat_params(model, torch.device("cpu"))
        workers.append((model, params, flat, grads, make_optimizer(params, case.run)))
    names = [n for n, _ in workers[0][0].named_parameters()]
    out = GoldenRun()
    for step in range(steps):
        x, y = global_batch(case, step)
        losses, grads_s = [], {}
        for r, (model, params, flat, grads, opt) in enumerate(workers):
            mbs = microbatches(dp_slice(x, r, d), dp_slice(y, r, d), m)
            losses.append(local_step(model, opt, grads, mbs))
            grads_s.update({f"w{r}/{n}": p.grad.detach().clone() for n, p in zip(names, params)})
        if is_sync_step(step, case.options.data.local_sgd_period):
            mean = torch.stack([w[2] for w in workers]).sum(0) / d
            for w in workers:
                w[2].copy_(mean)
        out.losses.append(sum(losses) / d)
        out.grads.append(grads_s)
        out.params.append({f"w{r}/{n}": p.detach().clone()
                           for r, w in enumerate(workers) for n, p in zip(names, w[1])})
    return out
