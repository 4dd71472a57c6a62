"""Reproducer (finding, torchtitan 0.3.0 on a CPU-only host, torch 2.13.0+cpu, gloo): the
meshes ``ParallelDims.build_mesh`` makes are "cuda" meshes, because
``torchtitan.tools.utils.device_type`` is fixed at import to the available accelerator or,
with none, "cuda"; the first parameter ``parallelize_llama`` distributes then fails with
"Torch not compiled with CUDA enabled". ``baseline.torchtitan`` points
``torchtitan.distributed.parallel_dims.device_type`` at the rank's device first.

Run: ``python scripts/torchtitan_cpu_mesh.py`` (two local ranks). Prints the mesh device
type torchtitan chose and whether it differs from the host's ("cpu").
"""
from __future__ import annotations

import os

import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29641")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from torchtitan.distributed import ParallelDims  # optional dependency
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=2, pp=1, ep=1, world_size=2,
                        spmd_backend="partial_dtensor")
    mesh = dims.build_mesh()
    if rank == 0:
        print(f"torchtitan mesh device_type={mesh.device_type!r} on a CPU-only host "
              f"({'BUG: not cpu' if mesh.device_type != 'cpu' else 'ok'})")
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(_rank, nprocs=2)
