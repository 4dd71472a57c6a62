"""What each calibration rank runs for communication: every collective at each group size over
a sweep of message sizes, send/recv between two ranks, whether a send waits for its receive,
and how much of an asynchronous all-reduce a GEMM loop hides."""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..comm import Ledger
from ..timeline import Timeline
from .local_model import local_modules
from .plan import Plan
from .timing import agree_max, barrier, sample_seconds, sync

#: (key "op:n", message bytes, the call, this rank is in the group, seconds per call factor)
Item = tuple[str, int, Callable[[], Any], bool, float]
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def collective_task(ctx, plan: Plan) -> dict:
    """Sweep every op over group sizes and message sizes; returns per (op, n): [(S, t)] as
    this rank saw it (non-members of a group return nothing for it)."""
    dev, rank = ctx.device, ctx.rank
    sizes = sorted(set(plan.group_sizes or range(2, ctx.world_size + 1)))
    groups = {n: None if n == ctx.world_size else dist.new_group(list(range(n)))
              for n in sizes}
    timeline = Timeline(rank, enabled=plan.instrumented)
    ledger = Ledger(timeline=timeline, recording=plan.instrumented)
    # what runs between two collectives of a step: the reference layer's forward and backward
    # at the model's shape (a GEMM loop without a model); its time is subtracted
    burst = _burst(plan, dev)
    # every (op, group size, message size) as an item; the items are timed round-robin,
    # repeatedly, so a load that drifts over the sweep hits every op alike
    items = collective_items(plan, dev, rank, groups) + p2p_items(plan, dev, rank)
    diffs = time_items(items, plan, dev, burst, ledger, timeline)
    result: dict[str, list] = {}
    for (key, S, call, member, scale), d in zip(items, diffs):
        if member:
            result.setdefault(key, []).append((S, max(statistics.median(d), 1e-7) * scale))
    blocks = send_blocks(rank, dev)
    if blocks is not None:
        result["send_blocks"] = [(1, blocks)]
    return result


def _call(op: str, g, buf, part, outb) -> Callable[[], None]:
    if op == "all_reduce":
        return lambda: dist.all_reduce(buf, group=g)
    if op == "all_gather":
        return lambda: dist.all_gather_into_tensor(outb, part, group=g)
    if op == "reduce_scatter":
        return lambda: dist.reduce_scatter_tensor(part, buf, group=g)
    return lambda: dist.all_to_all_single(outb, buf, group=g)


def collective_items(plan: Plan, dev: str, rank: int, groups: dict) -> list[Item]:
    """Each collective on each group (the first n ranks) at each message size."""
    items = []
    for n, g in groups.items():
        for op in COLLECTIVES:
            for S in plan.message_bytes:
                elems = max(n, (S // 4) // n * n)  # a multiple of n fp32 elements
                buf = torch.ones(elems, device=dev)
                part = torch.ones(elems // n, device=dev)
                outb = torch.empty(elems, device=dev)
                items.append((f"{op}:{n}", elems * 4, _call(op, g, buf, part, outb),
                              rank < n, 1.0))
    return items


def p2p_items(plan: Plan, dev: str, rank: int) -> list[Item]:
    """Point to point: ping-pong between ranks 0 and 1; one way = a round trip / 2."""
    items = []
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
    return items


def _timed(fn, k: int, dev: str) -> float:
    return sample_seconds(fn, k, dev)  # after a barrier; CUDA events on a GPU


def _after_burst(burst, call, member):
    def more():
        burst()
        if member:
            call()
    return more


def time_items(items: list[Item], plan: Plan, dev: str, burst, ledger, timeline
               ) -> list[list[float]]:
    """Per item, the samples of (burst + call) - burst, k calls each (k so a sample lasts
    ``min_time_s``, the slowest rank's k), taken round-robin ``repeats`` times."""
    ks = []
    for key, S, call, member, _ in items:
        if member:
            call()
        more = _after_burst(burst, call, member)
        more()
        sync(dev)
        t0 = time.perf_counter()
        more()
        sync(dev)
        one = agree_max(time.perf_counter() - t0, dev)
        ks.append(max(1, min(2000, int(plan.min_time_s / max(one, 1e-7)))))
    diffs: list[list[float]] = [[] for _ in items]
    with ledger:
        for _ in range(max(3, plan.repeats)):
            for i, (key, S, call, member, _) in enumerate(items):
                base = _timed(burst, ks[i], dev)
                diffs[i].append(_timed(_after_burst(burst, call, member), ks[i], dev) - base)
                ledger.clear()
                timeline.clear()
    return diffs


def send_blocks(rank: int, dev: str) -> float | None:
    """Does a send wait for its receive? Rank 1 posts its receive 5 ms late; a send that
    returns only then is a rendezvous (it occupies the sender until the receiver is ready).
    1.0 or 0.0 on rank 0, None elsewhere."""
    late = 0.005
    flag = torch.ones(1, device=dev)
    blocked = []
    for _ in range(3):
        barrier()
        if rank == 0:
            t0 = time.perf_counter()
            dist.send(flag, 1)
            blocked.append(time.perf_counter() - t0)
        elif rank == 1:
            time.sleep(late)
            dist.recv(flag, 0)
    if rank == 0:
        return float(statistics.median(blocked) > late / 2)
    return None


def _burst(plan: Plan, dev: str):
    """A step's compute between two collectives: the local reference layer forward and
    backward (tp = 1, the smallest micro-batch) when the plan has a model, else GEMMs."""
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


#: overlap samples taken at least (each a paired comm / GEMM loop / both triple), and the
#: all-reduce's fp32 elements (16 MB: long enough that a scheduler's hiccup of a few ms is a
#: small part of one sample)
OVERLAP_SAMPLES = 15
OVERLAP_ELEMENTS = 1 << 22


def overlap_task(ctx, plan: Plan) -> float:
    """Fraction of the shorter of (an all-reduce, a GEMM loop of about the same length) hidden
    when the all-reduce is issued asynchronously before the loop: the median over samples,
    each sample the three timed in turn (a machine whose load drifts moves all three alike),
    every time the slowest rank's."""
    dev = ctx.device
    buf = torch.ones(OVERLAP_ELEMENTS, device=dev)
    a = torch.randn(256, 256, device=dev)
    c = torch.empty(256, 256, device=dev)

    def comm():
        dist.all_reduce(buf)

    def mm(k):
        for _ in range(k):
            torch.mm(a, a, out=c)
        sync(dev)

    def once(fn) -> float:
        barrier()
        t0 = time.perf_counter()
        fn()
        sync(dev)
        return agree_max(time.perf_counter() - t0, dev)

    comm()
    t_comm = statistics.median(once(comm) for _ in range(plan.repeats))
    one = statistics.median(once(lambda: mm(1)) for _ in range(plan.repeats))
    k = int(agree_max(max(1, int(t_comm / max(one, 1e-7))), dev))

    def both():
        w = dist.all_reduce(buf, async_op=True)
        mm(k)
        w.wait()

    fractions = []
    for _ in range(max(OVERLAP_SAMPLES, plan.repeats)):
        tc, tm, tb = once(comm), once(lambda: mm(k)), once(both)
        fractions.append((tc + tm - tb) / max(min(tc, tm), 1e-9))
    return max(0.0, min(1.0, statistics.median(fractions)))
