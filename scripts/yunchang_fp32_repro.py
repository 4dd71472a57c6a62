"""Finding: yunchang 0.6.4's ring attention backward is wrong for fp32 inputs; minimal
reproducer (CPU, gloo, 2 local ranks, one ring of 2, no Ulysses level).

yunchang's ``ring_flash_attn_backward`` and ``zigzag_ring_flash_attn_backward``
(``yunchang/ring/``, adapted from zhuzilin/ring-flash-attention) allocate one dq / dk / dv
buffer, let the block kernel write each block's gradient into it, and start the accumulators
with ``dq = dq_buffer.to(torch.float32)``. For half-precision inputs (flash-attn's only
dtypes) that is a copy; for fp32 ``Tensor.to`` returns the buffer itself, so the next
block's kernel overwrites the accumulator (``dq += dq_buffer`` then adds the new block
twice, the old one never). The zigzag ring also hands that alias (``dk_comm_buffer = dk``)
back as a receive buffer. Besides, the basic ring returns ``dq.to(torch.bfloat16)`` for any
input dtype (a rounding of dq to 8 bits of mantissa).

The block kernel here is parbench's CPU shim (``impls.baselines.yunchang_kernels``: torch's
CPU flash attention under flash-attn's contract). It is not the cause: with float64 inputs,
for which ``.to(torch.float32)`` copies, the zigzag ring agrees with
``F.scaled_dot_product_attention`` to fp32 rounding (~1e-7); with fp32 inputs, dq is off by
O(1). A ring of one rank (``ring`` = 1) fails on gloo: the backward sends dK, dV to the rank
itself ("Pair is not connected").

Run: ``PYTHONPATH=. python scripts/yunchang_fp32_repro.py`` (needs yunchang).
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

CASES = [("zigzag", torch.float64), ("zigzag", torch.float32), ("basic", torch.float32)]


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                          v.transpose(1, 2), is_causal=True).transpose(1, 2)


def _errors(rank: int, world: int, impl: str, dtype) -> list[float]:
    """max |yunchang - SDPA| of out, dq, dk, dv on this rank's tokens."""
    from yunchang import EXTRACT_FUNC_DICT
    from yunchang.globals import PROCESS_GROUP

    from impls.baselines.yunchang_usp import long_context_attention
    attn = long_context_attention(PROCESS_GROUP.ULYSSES_PG, PROCESS_GROUP.RING_PG, impl)
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(1, 16, 2, 8).to(dtype) for _ in range(4))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    _sdpa(*full).backward(dout)

    def local(t):
        return EXTRACT_FUNC_DICT[impl](t.detach(), rank, world, rd=world, ud=1)
    mine = [local(t).requires_grad_() for t in (q, k, v)]
    out = attn(*mine, causal=True)
    out.backward(local(dout))
    ref = _sdpa(*(t.detach() for t in full))
    return [(out - local(ref)).abs().max().item()] + \
        [(m.grad - local(f.grad)).abs().max().item() for m, f in zip(mine, full)]


def _rank(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from yunchang import set_seq_parallel_pg
    set_seq_parallel_pg(1, world, rank, world)  # no Ulysses level, one ring of `world`
    for impl, dtype in CASES:
        e = _errors(rank, world, impl, dtype)
        print(f"ring={world} {impl:6s} {str(dtype):13s} rank {rank}: max|diff| out "
              f"{e[0]:.1e}  dq {e[1]:.1e}  dk {e[2]:.1e}  dv {e[3]:.1e}", flush=True)
        dist.barrier()
    dist.destroy_process_group()


def _ring_of_one(rank: int, port: int) -> None:
    """One rank, one ring of one: the backward's dK, dV sent to the rank itself."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=1)
    from yunchang import set_seq_parallel_pg
    set_seq_parallel_pg(1, 1, 0, 1)
    try:
        _errors(0, 1, "basic", torch.float64)
        print("ring=1 basic: ok")
    except RuntimeError as e:
        print("ring=1 basic: FAIL", str(e).splitlines()[0][-90:])
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    print("fp32 Tensor.to(float32) aliases:", (lambda b: b.to(torch.float32) is b)(
        torch.empty(2)))
    mp.spawn(_rank, args=(2, 29500 + os.getpid() % 1000), nprocs=2)
    mp.spawn(_ring_of_one, args=(28500 + os.getpid() % 1000,), nprocs=1)
