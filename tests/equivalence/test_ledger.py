"""The ledger sees every thread and every op: a collective from another thread, DTensor's
functional collectives, rooted ops charged by role, real peers for batched point-to-point."""
from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from parbench.comm import Ledger


def _from_another_thread(ctx):
    t = torch.ones(256)
    with Ledger() as led:
        worker = threading.Thread(target=lambda: dist.all_reduce(t), name="autograd-like")
        worker.start()
        worker.join()
    return [(r.op, r.thread, r.message_bytes, r.wire_bytes) for r in led.records]


def test_a_collective_from_another_thread_is_recorded(pools):
    for records in pools(2).run(_from_another_thread):
        assert records == [("all_reduce", "autograd-like", 1024, 1024.0)]  # 2(n-1)/n x 1024


def _dtensor_step(ctx):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    torch.manual_seed(0)
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 8))
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "1": RowwiseParallel()})
    x = torch.randn(4, 8, requires_grad=True)
    with Ledger() as led:
        model(x).sum().backward()
    return [(r.op, r.api, r.message_bytes, r.wire_bytes) for r in led.records]


def test_dtensor_traffic_is_in_the_ledger_with_its_bytes(pools):
    """Megatron's f/g pair as DTensor does it: the row-parallel output all-reduced forward,
    the column-parallel input gradient all-reduced backward, each 4 x 8 fp32 = 128 bytes."""
    for records in pools(2).run(_dtensor_step):
        assert sorted(records) == [("all_reduce", "functional", 128, 128.0)] * 2, records


def _rooted_and_batched(ctx):
    rank = dist.get_rank()
    t = torch.ones(100)  # 400 bytes
    peer = 1 - rank
    with Ledger() as led:
        dist.broadcast(t, src=0)
        dist.reduce(t, dst=0)
        ops = [dist.P2POp(dist.isend, t, peer), dist.P2POp(dist.irecv, torch.empty(100), peer)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
    return [(r.op, r.wire_bytes, r.peer) for r in led.records]


def test_rooted_ops_are_charged_by_role_and_batched_p2p_names_its_peer(pools):
    rank0, rank1 = pools(2).run(_rooted_and_batched)
    # broadcast: a chain from the root, whose last rank sends nothing; reduce: every rank but
    # the root sends its partial sum
    assert rank0[:2] == [("broadcast", 400.0, -1), ("reduce", 0.0, -1)]
    assert rank1[:2] == [("broadcast", 0.0, -1), ("reduce", 400.0, -1)]
    assert sorted(rank0[2:]) == [("recv", 0.0, 1), ("send", 400.0, 1)]
    assert sorted(rank1[2:]) == [("recv", 0.0, 0), ("send", 400.0, 0)]


def _uneven_all_to_all(ctx):
    rank = dist.get_rank()
    # rank 0 sends all 6 rows to rank 1; rank 1 keeps 2 rows and sends 1 to rank 0
    splits = [[0, 6], [1, 2]][rank]
    inp = torch.ones(sum(splits), 4)
    out_splits = [[0, 1], [6, 2]][rank]
    out = torch.empty(sum(out_splits), 4)
    with Ledger() as led:
        dist.all_to_all_single(out, inp, out_splits, splits)
    return [(r.op, r.message_bytes, r.wire_bytes) for r in led.records]


def test_uneven_all_to_all_charges_the_bytes_sent_to_the_others(pools):
    rank0, rank1 = pools(2).run(_uneven_all_to_all)
    assert rank0 == [("all_to_all", 96, 96.0)]  # 6 rows x 16 bytes, none kept
    assert rank1 == [("all_to_all", 48, 16.0)]  # 3 rows, 2 of them its own
