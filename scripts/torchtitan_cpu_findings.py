"""Reproducers (findings, torchtitan 0.3.0 on a CPU-only host, torch 2.13.0+cpu, gloo), two
local ranks; each prints what it found. ``baseline.torchtitan`` works around both.

1. ``mesh``: the meshes ``ParallelDims.build_mesh`` makes are "cuda" meshes, because
   ``torchtitan.tools.utils.device_type`` is fixed at import to the available accelerator
   or, with none, "cuda"; building the meshes then fails (on a bare gloo world: "Unknown c10d
   backend type FAKE"; where the groups exist, as in parbench's ranks, ``parallelize_llama``'s
   first ``distribute_tensor``: "Torch not compiled with CUDA enabled").
2. ``premul``: torchtitan's ``disable_fsdp_gradient_division`` sets FSDP2's gradient divide
   factor to 1.0, and FSDP2 then reduce-scatters with ``ReduceOp.PREMUL_SUM``, which Gloo
   refuses ("Cannot use ReduceOp.PREMUL_SUM with Gloo") at the first backward with dp > 1.

Run: ``python scripts/torchtitan_cpu_findings.py``.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _mesh(rank: int) -> None:
    from torchtitan.distributed import ParallelDims  # optional dependency
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=2, pp=1, ep=1, world_size=2,
                        spmd_backend="partial_dtensor")
    import torchtitan.tools.utils as titan_utils  # optional dependency
    try:
        dims.build_mesh()
        outcome = "ok"
    except (AssertionError, RuntimeError) as e:  # where the "cuda" mesh fails first
        outcome = f"{type(e).__name__}: {e}"
    if rank == 0:
        print(f"mesh: torchtitan device_type={titan_utils.device_type!r} on a CPU-only host "
              f"({'FINDING: not cpu' if titan_utils.device_type != 'cpu' else 'ok'}); "
              f"ParallelDims.build_mesh: {outcome}")


def _premul(rank: int) -> None:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torchtitan.distributed.fsdp import disable_fsdp_gradient_division  # optional
    model = torch.nn.Linear(4, 4)
    fully_shard(model, mesh=DeviceMesh.from_group(dist.group.WORLD, "cpu"))
    disable_fsdp_gradient_division(model)
    try:
        model(torch.ones(2, 4)).sum().backward()
        outcome = "ok"
    except RuntimeError as e:
        outcome = f"FINDING: {e}"
    if rank == 0:
        print(f"premul: FSDP2 backward with torchtitan's divide factor 1.0 on gloo: {outcome}")


def _rank(rank: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29641")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    _mesh(rank)
    _premul(rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(_rank, nprocs=2)
