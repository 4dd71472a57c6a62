"""Single-device runs of the asynchronous update rules (the golden runs PipeDream and
PipeDream-2BW are compared with; the rules themselves: see ``asynchronous``)."""
from __future__ import annotations

import torch
from torch.func import functional_call

from parbench.batching import microbatches
from parbench.golden import GoldenRun, global_batch
from parbench.model import build_model, build_stage, make_optimizer

from .async_weights import snapshot, stage_delay


def pipedream_reference(case, steps: int) -> GoldenRun:
    """Single device, same rule: stage s of micro-batch G runs on version G-(p-1-s)."""
    cfg, run = case.model, case.run
    p, m = case.parallel.pp, case.parallel.num_microbatches
    stages = [build_stage(cfg, run.seed, s, p) for s in range(p)]
    opts = [make_optimizer(stage.parameters(), run) for stage in stages]
    history = [{0: snapshot(stage.named_parameters())} for stage in stages]
    out, global_mb = GoldenRun(), 0
    for step in range(steps):
        x, y = global_batch(case, step)
        grad_mean = {n: torch.zeros_like(t) for stage in stages
                     for n, t in stage.named_parameters()}
        losses = []
        for xm, ym in microbatches(x, y, m):
            used = [history[s][max(0, global_mb - stage_delay(p, s))] for s in range(p)]
            hidden = xm
            for s, stage in enumerate(stages):
                hidden = functional_call(stage, used[s], (hidden, ym))
            loss = hidden  # the last stage returns the loss
            tensors = [t for d in used for t in d.values()]
            grads = torch.autograd.grad(loss, tensors)
            losses.append(float(loss.detach()))
            grads_in_order = iter(grads)
            for s, stage in enumerate(stages):
                for (n, prm), g in zip(stage.named_parameters(), grads_in_order):
                    prm.grad = g
                    grad_mean[n].add_(g / m)
                opts[s].step()
                history[s][global_mb + 1] = snapshot(stage.named_parameters())
            global_mb += 1
        out.losses.append(sum(losses) / m)
        out.grads.append(grad_mean)
        out.params.append({n: t.detach().clone() for stage in stages
                           for n, t in stage.named_parameters()})
    return out


def two_bw_reference(case, steps: int) -> GoldenRun:
    """Single device: loss and gradient of batch t at W(t-1); AdamW step on W(t)."""
    cfg, run = case.model, case.run
    model = build_model(cfg, run.seed)
    opt = make_optimizer(model.parameters(), run)
    shadow = snapshot(model.named_parameters())
    out = GoldenRun()
    for step in range(steps):
        x, y = global_batch(case, step)
        loss = functional_call(model, shadow, (x, y))
        grads = torch.autograd.grad(loss, list(shadow.values()))
        older = snapshot(model.named_parameters())
        for prm, g in zip(model.parameters(), grads):
            prm.grad = g
        opt.step()
        shadow = older
        out.losses.append(float(loss.detach()))
        out.grads.append({n: g.detach().clone() for n, g in zip(shadow, grads)})
        out.params.append({n: t.detach().clone() for n, t in model.named_parameters()})
    return out
