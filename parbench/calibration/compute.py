"""What each calibration rank runs for compute: GEMMs at the model's shapes, fused attention,
memory bandwidth, the fixed costs of an eager operator, an autograd node, a ``backward()``
call and a re-entry into a kept graph, the model's in-graph layer costs, AdamW -- and the
reference model's whole step (a check of the compute model, not an input to it)."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..config import RunConfig
from ..model import build_model, make_optimizer, synthetic_batch
from .plan import Plan, model_config
from .reentry import reentry_costs
from .timing import dtype_of, time_parts, timeit


def compute_task(ctx, plan: Plan) -> dict:
    """Every rank times the same compute at the same time (cores and memory shared as in a
    run); returns this rank's medians."""
    dev = ctx.device
    out: dict[str, Any] = {"gemms": [], "attention": []}
    for dt in plan.dtypes:
        out["gemms"] += gemm_times(plan, dev, dt)
        out["attention"] += attention_times(plan, dev, dt)
    out.update(memory_and_overheads(plan, dev))
    out.update(reentry_costs(dev, lambda fn: timeit(fn, dev, plan.min_time_s,
                                                    plan.repeats)))
    if plan.shape is not None:
        for dt in plan.dtypes:
            out["parts"] = out.get("parts", []) + time_parts(plan, dev, dt)
    out["optimizer"] = optimizer_costs(plan, dev)
    return out


def gemm_times(plan: Plan, dev: str, dt: str) -> list[dict]:
    """Square GEMMs (the peak) and the model's GEMMs, each call's fixed cost included."""
    dtype, out = dtype_of(dt), []
    shapes = [(n, n, n) for n in plan.square_sizes] + plan.gemm_shapes()
    for m, n, k in shapes:
        a = torch.randn(m, k, device=dev).to(dtype)
        b = torch.randn(k, n, device=dev).to(dtype)
        c = torch.empty(m, n, device=dev, dtype=dtype)
        sec = timeit(lambda: torch.mm(a, b, out=c), dev, plan.min_time_s, plan.repeats)
        out.append({"m": m, "n": n, "k": k, "dtype": dt, "seconds": sec})
    return out


def attention_times(plan: Plan, dev: str, dt: str) -> list[dict]:
    """Fused attention (causal when the query attends to its own sequence), forward and
    backward, at the model's head shapes."""
    dtype, out = dtype_of(dt), []
    mt, reps = plan.min_time_s, plan.repeats
    for (b_, heads, sq, skv, d) in plan.attention_shapes():
        q = torch.randn(b_, heads, sq, d, device=dev, dtype=dtype, requires_grad=True)
        kk = torch.randn(b_, heads, skv, d, device=dev, dtype=dtype, requires_grad=True)
        v = torch.randn(b_, heads, skv, d, device=dev, dtype=dtype, requires_grad=True)
        causal = sq == skv
        g = torch.randn(b_, heads, sq, d, device=dev, dtype=dtype)

        def fwd():
            return F.scaled_dot_product_attention(q, kk, v, is_causal=causal)

        def fwd_bwd():
            fwd().backward(g)

        tf = timeit(fwd, dev, mt, reps)
        tfb = timeit(fwd_bwd, dev, mt, reps)
        out.append({"b": b_, "heads": heads, "sq": sq, "skv": skv, "d": d,
                    "dtype": dt, "fwd_s": tf, "bwd_s": max(tfb - tf, 0.0)})
    return out


def memory_and_overheads(plan: Plan, dev: str) -> dict:
    """Memory bandwidth (a large copy, read + write) and the fixed costs of one eager op, one
    autograd node and one ``backward()`` call (a chain of k scalar multiplies for two k: the
    slope and the intercept)."""
    mt, reps = plan.min_time_s, plan.repeats
    n = plan.copy_bytes // 4
    src = torch.empty(n, device=dev)
    dst = torch.empty(n, device=dev)
    src.fill_(1.0)
    dst.fill_(0.0)
    t = timeit(lambda: dst.copy_(src), dev, mt, reps)
    out = {"mem_bandwidth": 2 * n * 4 / t}
    x1 = torch.ones(1, device=dev)
    out["op_overhead_s"] = timeit(lambda: x1 + x1, dev, mt, reps)
    leaf = torch.ones(16, device=dev, requires_grad=True)

    def chain(k):
        def run():
            y = leaf
            for _ in range(k):
                y = y * 1.0001
            y.sum().backward()
        return run

    k1, k2 = 1, 33
    t1 = timeit(chain(k1), dev, mt, reps)
    t2 = timeit(chain(k2), dev, mt, reps)
    per_op = (t2 - t1) / (k2 - k1)  # forward op + its backward node
    out["bwd_op_overhead_s"] = max(per_op - out["op_overhead_s"], 0.0)
    out["backward_call_s"] = max(t1 - 2 * per_op, 0.0)  # the sum and one multiply removed
    return out


def optimizer_costs(plan: Plan, dev: str) -> dict:
    """AdamW (single-tensor, as parbench's ``make_optimizer``) with zero_grad: seconds per
    tensor and per element, from two (tensors, elements) points."""
    opt_pts = []
    for count, numel in ((64, 16), (4, 1 << 16)):
        ps = [torch.zeros(numel, device=dev, requires_grad=True) for _ in range(count)]
        for p in ps:
            p.grad = torch.ones_like(p)
        opt = torch.optim.AdamW(ps, lr=1e-3, foreach=False)

        def ostep(opt=opt):
            opt.step()
            opt.zero_grad(set_to_none=False)

        opt_pts.append((count, count * numel, timeit(ostep, dev, plan.min_time_s,
                                                     plan.repeats)))
    (c1, e1, s1), (c2, e2, s2) = opt_pts
    det = c1 * e2 - c2 * e1
    per_elem = max((c1 * s2 - c2 * s1) / det, 0.0) if det else 0.0
    per_tensor = max((s1 - e1 * per_elem) / c1, 0.0)
    return {"per_tensor_s": per_tensor, "per_element_s": per_elem}


def reference_task(ctx, model_name: str, b: int, m: int, min_time: float, repeats: int
                   ) -> float:
    """The reference model's single-rank training step (m micro-batches of b, AdamW) on every
    rank at once: a check of the compute model, not an input to it."""
    cfg = model_config(model_name)
    model = build_model(cfg, 0).to(ctx.device)
    opt = make_optimizer(model.parameters(), RunConfig())
    x, y = synthetic_batch(cfg, b, 0, 0)
    x, y = x.to(ctx.device), y.to(ctx.device)

    def step():
        for _ in range(m):
            model(x, y).div(m).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)

    return timeit(step, ctx.device, min_time, repeats)
