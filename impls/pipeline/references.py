"""Single-device runs of the asynchronous update rules: the golden runs PipeDream and
PipeDream-2BW are compared with (the rules and the per-step state: see ``asynchronous``).

Both run the micro-batches of the whole run one after another on one device and report,
for every checked step t and every stage s, what stage s of the continuous pipeline holds
after step t: the updates of the micro-batches whose backward it has completed, which lag
the step's forwards by the stage's warm-up p-1-s, and all of them after the draining last
step.
"""
from __future__ import annotations

import torch
from torch.func import functional_call

from parbench.batching import microbatches
from parbench.golden import GoldenRun, global_batch
from parbench.model import build_model, build_stage, make_optimizer


def _snapshot(named) -> dict[str, torch.Tensor]:
    return {n: torch.nn.Parameter(t.detach().clone()) for n, t in named}


def _completed(p: int, m: int, stage: int, step: int, total: int) -> int:
    """Backwards stage s has completed after ``step`` (the drain completes them all)."""
    if step >= total - 1:
        return total * m
    return max(0, (step + 1) * m - (p - 1 - stage))


def _layout(case):
    cfg, run, par = case.model, case.run, case.layout
    total = run.steps + run.timed_steps
    return cfg, run, par.pp, par.num_microbatches, total


def pipedream_reference(case, steps: int) -> GoldenRun:
    """Single device, same rule: stage s of micro-batch g runs on version g-(p-1-s); each
    stage steps its optimizer after every micro-batch."""
    cfg, run, p, m, total = _layout(case)
    stages = [build_stage(cfg, run.seed, s, p) for s in range(p)]
    names = [[n for n, _ in st.named_parameters()] for st in stages]
    opts = [make_optimizer(st.parameters(), run) for st in stages]
    history = [{0: _snapshot(st.named_parameters())} for st in stages]
    # the version whose parameters (and the gradient that made it) each step reports
    want = {(s, _completed(p, m, s, t, total)): t for s in range(p) for t in range(steps)}
    n_mb = max(u for _, u in want)
    out = GoldenRun()
    out.params = [{} for _ in range(steps)]
    out.grads = [{} for _ in range(steps)]
    losses: list[float] = []
    for g in range(n_mb):
        step, i = divmod(g, m)
        x, y = global_batch(case, step)
        xm, ym = microbatches(x, y, m)[i]
        used = [history[s][max(0, g - (p - 1 - s))] for s in range(p)]
        hidden = xm
        for s, stage in enumerate(stages):
            hidden = functional_call(stage, used[s], (hidden, ym))
        loss = hidden  # the last stage returns the loss
        grads = iter(torch.autograd.grad(loss, [t for d in used for t in d.values()]))
        losses.append(float(loss.detach()))
        for s, stage in enumerate(stages):
            applied = {}
            for (n, prm), gr in zip(stage.named_parameters(), grads):
                prm.grad = gr
                applied[n] = gr.detach().clone()
            opts[s].step()
            history[s][g + 1] = _snapshot(stage.named_parameters())
            for old in [v for v in history[s] if v < g + 1 - (p - 1 - s)]:
                del history[s][old]
            t = want.get((s, g + 1))
            if t is not None:
                out.params[t].update({n: history[s][g + 1][n].detach() for n in names[s]})
                out.grads[t].update(applied)
    out.losses = [sum(losses[t * m:(t + 1) * m]) / m for t in range(steps)]
    return out


def two_bw_reference(case, steps: int) -> GoldenRun:
    """Single device: batch t's micro-batch gradients at W(t-1), accumulated; W(t+1) =
    AdamW(W(t), their sum). Stage s after step t: W(t+1) and batch t's gradient on the last
    stage; W(t) and the sum over batch t's first m-(p-1-s) micro-batches before it."""
    cfg, run, p, m, total = _layout(case)
    model = build_model(cfg, run.seed)
    opt = make_optimizer(model.parameters(), run)
    names = [[n for n, _ in build_stage(cfg, run.seed, s, p).named_parameters()]
             for s in range(p)]
    shadow = _snapshot(model.named_parameters())  # W(t-1)
    out = GoldenRun()
    batches = total if steps == total else steps
    for t in range(batches):
        x, y = global_batch(case, t)
        acc = {n: torch.zeros_like(v) for n, v in shadow.items()}
        partial: dict[int, dict] = {}  # micro-batches done -> the running sums then
        losses = []
        for i, (xm, ym) in enumerate(microbatches(x, y, m)):
            loss = functional_call(model, shadow, (xm, ym))
            grads = torch.autograd.grad(loss / m, list(shadow.values()))
            losses.append(float(loss.detach()))
            for (n, a), gr in zip(acc.items(), grads):
                a.add_(gr)
            partial[i + 1] = {n: a.clone() for n, a in acc.items()}
        older = _snapshot(model.named_parameters())  # W(t)
        for prm, a in zip(model.parameters(), acc.values()):
            prm.grad = a.clone()
        opt.step()  # W(t+1)
        shadow = older
        if t >= steps:
            continue
        newest = {n: v.detach().clone() for n, v in model.named_parameters()}
        params, grads = {}, {}
        for s in range(p):
            lag = p - 1 - s
            drained = t >= total - 1
            done = m if drained or lag == 0 else m - lag
            src = newest if drained or lag == 0 else {n: v.detach() for n, v in older.items()}
            params.update({n: src[n] for n in names[s]})
            grads.update({n: partial[done][n] for n in names[s]})
        out.losses.append(sum(losses) / m)
        out.grads.append(grads)
        out.params.append(params)
    return out
