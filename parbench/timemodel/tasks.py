"""What each calibration rank runs: the compute task (GEMMs at the model's shapes, memory
bandwidth, fixed costs, the optimizer), the collective task (each collective at each group
size over a sweep of message sizes) and the overlap task."""
from __future__ import annotations

from typing import Any, Callable
import statistics
import time

from .calibration_plan import Plan
from .timing import _agree_max, _barrier, _dtype, local_modules, _sync, _time_parts, _timeit


# ---------------------------------------------------------------------------------------
# rank tasks
# ---------------------------------------------------------------------------------------

def compute_task(ctx, plan: Plan) -> dict:
    """Every rank times the same compute at the same time (cores and memory shared as in a
    run); returns this rank's medians."""
    import torch
    import torch.nn.functional as F
    dev = ctx.device
    mt, reps = plan.min_time_s, plan.repeats
    out: dict[str, Any] = {"gemms": [], "attention": []}
    for dt in plan.dtypes:
        dtype = _dtype(dt)
        shapes = [(n, n, n) for n in plan.square_sizes] + plan.gemm_shapes()
        for m, n, k in shapes:
            a = torch.randn(m, k, device=dev).to(dtype)
            b = torch.randn(k, n, device=dev).to(dtype)
            c = torch.empty(m, n, device=dev, dtype=dtype)
            sec = _timeit(lambda: torch.mm(a, b, out=c), dev, mt, reps)
            out["gemms"].append({"m": m, "n": n, "k": k, "dtype": dt, "seconds": sec})
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

            tf = _timeit(fwd, dev, mt, reps)
            tfb = _timeit(fwd_bwd, dev, mt, reps)
            out["attention"].append({"b": b_, "heads": heads, "sq": sq, "skv": skv, "d": d,
                                     "dtype": dt, "fwd_s": tf, "bwd_s": max(tfb - tf, 0.0)})
    # memory bandwidth: a large copy (read + write)
    n = plan.copy_bytes // 4
    src = torch.empty(n, device=dev)
    dst = torch.empty(n, device=dev)
    src.fill_(1.0)
    dst.fill_(0.0)
    t = _timeit(lambda: dst.copy_(src), dev, mt, reps)
    out["mem_bandwidth"] = 2 * n * 4 / t
    # fixed costs: one eager op; one autograd node; one backward() call
    x1 = torch.ones(1, device=dev)
    out["op_overhead_s"] = _timeit(lambda: x1 + x1, dev, mt, reps)
    leaf = torch.ones(16, device=dev, requires_grad=True)

    def chain(k):
        def run():
            y = leaf
            for _ in range(k):
                y = y * 1.0001
            y.sum().backward()
        return run

    k1, k2 = 1, 33
    t1 = _timeit(chain(k1), dev, mt, reps)
    t2 = _timeit(chain(k2), dev, mt, reps)
    per_op = (t2 - t1) / (k2 - k1)  # forward op + its backward node
    out["bwd_op_overhead_s"] = max(per_op - out["op_overhead_s"], 0.0)
    out["backward_call_s"] = max(t1 - 2 * per_op, 0.0)  # the sum and one multiply removed
    if plan.shape is not None:
        for dt in plan.dtypes:
            out["parts"] = out.get("parts", []) + _time_parts(plan, dev, dt)
    # AdamW (single-tensor, as parbench's make_optimizer) with zero_grad, per tensor and
    # per element
    opt_pts = []
    for count, numel in ((64, 16), (4, 1 << 16)):
        ps = [torch.zeros(numel, device=dev, requires_grad=True) for _ in range(count)]
        for p in ps:
            p.grad = torch.ones_like(p)
        opt = torch.optim.AdamW(ps, lr=1e-3, foreach=False)

        def ostep(opt=opt):
            opt.step()
            opt.zero_grad(set_to_none=False)

        opt_pts.append((count, count * numel, _timeit(ostep, dev, mt, reps)))
    (c1, e1, s1), (c2, e2, s2) = opt_pts
    det = c1 * e2 - c2 * e1
    per_elem = max((c1 * s2 - c2 * s1) / det, 0.0) if det else 0.0
    per_tensor = max((s1 - e1 * per_elem) / c1, 0.0)
    out["optimizer"] = {"per_tensor_s": per_tensor, "per_element_s": per_elem}
    return out


def _reference_task(ctx, model_name: str, b: int, m: int, min_time: float, repeats: int
                    ) -> float:
    """The reference model's single-rank training step (m micro-batches of b, AdamW) on every
    rank at once: a check of the compute model, not an input to it."""
    import torch

    from ..config import RunConfig, model_preset
    from ..model import build_model, make_optimizer, synthetic_batch
    cfg = model_preset(model_name)
    model = build_model(cfg, 0).to(ctx.device)
    opt = make_optimizer(model.parameters(), RunConfig())
    x, y = synthetic_batch(cfg, b, 0, 0)
    x, y = x.to(ctx.device), y.to(ctx.device)

    def step():
        for _ in range(m):
            model(x, y).div(m).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)

    del torch
    return _timeit(step, ctx.device, min_time, repeats)


def collective_task(ctx, plan: Plan) -> dict:
    """Sweep every op over group sizes and message sizes; returns per (op, n): [(S, t)] as
    this rank saw it (non-members of a group return nothing for it)."""
    import torch
    import torch.distributed as dist

    from ..comm import Ledger
    from ..timeline import Timeline
    dev = ctx.device
    world = ctx.world_size
    rank = ctx.rank
    sizes = sorted(set(plan.group_sizes or range(2, world + 1)))
    groups = {}
    for n in sizes:
        groups[n] = None if n == world else dist.new_group(list(range(n)))
    result: dict[str, list] = {}
    timeline = Timeline(rank, enabled=plan.instrumented)
    ledger = Ledger(timeline=timeline, recording=plan.instrumented)

    # what runs between two collectives of a step: the reference layer's forward and backward
    # at the model's shape (a GEMM loop without a model); its time is subtracted
    burst = _burst(plan, dev)

    # every (op, group size, message size) as an item; the items are timed round-robin,
    # repeatedly, so a load that drifts over the sweep hits every op alike
    items: list[tuple[str, int, Callable[[], Any], bool, float]] = []
    for n in sizes:
        g = groups[n]
        member = rank < n
        for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
            for S in plan.message_bytes:
                elems = max(n, (S // 4) // n * n)  # a multiple of n fp32 elements
                buf = torch.ones(elems, device=dev)
                part = torch.ones(elems // n, device=dev)
                outb = torch.empty(elems, device=dev)
                if op == "all_reduce":
                    def call(buf=buf, g=g):
                        dist.all_reduce(buf, group=g)
                elif op == "all_gather":
                    def call(part=part, outb=outb, g=g):
                        dist.all_gather_into_tensor(outb, part, group=g)
                elif op == "reduce_scatter":
                    def call(part=part, buf=buf, g=g):
                        dist.reduce_scatter_tensor(part, buf, group=g)
                else:
                    def call(buf=buf, outb=outb, g=g):
                        dist.all_to_all_single(outb, buf, group=g)
                items.append((f"{op}:{n}", elems * 4, call, member, 1.0))
    # point to point: ping-pong between ranks 0 and 1; one way = a round trip / 2
    for S in plan.message_bytes:
        elems = max(1, S // 4)
        pbuf = torch.ones(elems, device=dev)

        def ping(buf=pbuf):
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            elif rank == 1:
                dist.recv(buf, 0)
                dist.send(buf, 0)

        items.append(("send:2", elems * 4, ping, rank < 2, 0.5))

    def timed(fn, k: int) -> float:
        _barrier()
        t0 = time.perf_counter()
        for _ in range(k):
            fn()
        _sync(dev)
        return (time.perf_counter() - t0) / k

    def more_of(call, member):
        def more():
            burst()
            if member:
                call()
        return more

    ks = []
    for key, S, call, member, _ in items:
        if member:
            call()
        more = more_of(call, member)
        more()
        _sync(dev)
        t0 = time.perf_counter()
        more()
        _sync(dev)
        one = _agree_max(time.perf_counter() - t0, dev)
        ks.append(max(1, min(2000, int(plan.min_time_s / max(one, 1e-7)))))
    diffs: list[list[float]] = [[] for _ in items]
    with ledger:
        for _ in range(max(3, plan.repeats)):
            for i, (key, S, call, member, _) in enumerate(items):
                base = timed(burst, ks[i])
                diffs[i].append(timed(more_of(call, member), ks[i]) - base)
                ledger.records.clear()
                ledger._exact.clear()
                timeline.clear()
    for (key, S, call, member, scale), d in zip(items, diffs):
        if member:
            result.setdefault(key, []).append((S, max(statistics.median(d), 1e-7) * scale))
    # does a send wait for its receive? rank 1 posts its receive 5 ms late; a send that
    # returns only then is a rendezvous (it occupies the sender until the receiver is ready)
    late = 0.005
    flag = torch.ones(1, device=dev)
    blocked = []
    for _ in range(3):
        _barrier()
        if rank == 0:
            t0 = time.perf_counter()
            dist.send(flag, 1)
            blocked.append(time.perf_counter() - t0)
        elif rank == 1:
            time.sleep(late)
            dist.recv(flag, 0)
    if rank == 0:
        result["send_blocks"] = [(1, float(statistics.median(blocked) > late / 2))]
    return result


def _burst(plan: Plan, dev: str):
    """A step's compute between two collectives: the local reference layer forward and
    backward (tp = 1, the smallest micro-batch) when the plan has a model, else GEMMs."""
    import torch
    if plan.shape is not None:
        layer, _, _ = local_modules(plan.shape, 1, torch.float32)
        layer = layer.to(dev)
        b = plan.micro_batch_sizes[0]
        x = torch.randn(b, plan.shape.s, plan.shape.h, device=dev, requires_grad=True)
        g = torch.randn_like(x)

        def run():
            layer(x).backward(g)
        return run
    a = torch.randn(128, 128, device=dev)
    c = torch.empty(128, 128, device=dev)

    def mm():
        for _ in range(4):
            torch.mm(a, a, out=c)
    return mm


def overlap_task(ctx, plan: Plan) -> float:
    """Fraction of the shorter of (an all-reduce, a GEMM loop of about the same length) hidden
    when the all-reduce is issued asynchronously before the loop."""
    import torch
    import torch.distributed as dist
    dev = ctx.device
    n = 1 << 20  # 4 MB
    buf = torch.ones(n, device=dev)
    a = torch.randn(256, 256, device=dev)
    c = torch.empty(256, 256, device=dev)

    def comm():
        dist.all_reduce(buf)

    def mm(k):
        for _ in range(k):
            torch.mm(a, a, out=c)
        _sync(dev)

    def timed(fn) -> float:
        out = []
        for _ in range(plan.repeats):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            _sync(dev)
            out.append(time.perf_counter() - t0)
        t = torch.tensor([statistics.median(out)], dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    comm()
    t_comm = timed(comm)
    one = timed(lambda: mm(1))
    k = max(1, int(t_comm / max(one, 1e-7)))
    kt = torch.tensor([k], device=dev)
    dist.all_reduce(kt, op=dist.ReduceOp.MAX)
    k = int(kt.item())
    t_mm = timed(lambda: mm(k))

    def both():
        w = dist.all_reduce(buf, async_op=True)
        mm(k)
        w.wait()

    t_both = timed(both)
    hidden = t_comm + t_mm - t_both
    return max(0.0, min(1.0, hidden / max(min(t_comm, t_mm), 1e-9)))
