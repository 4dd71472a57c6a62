"""What yunchang 0.6.4 (PyPI ``yunchang``, USP: Fang & Zhao 2024, arXiv 2405.07719) does on a
CPU-only host (torch 2.13.0+cpu, gloo), stock -- no parbench shim. Prints one line per
(ring implementation, attention kernel, forward / backward): ``ok`` with the largest
difference from ``F.scaled_dot_product_attention``, or the failing call's error.

Found (the reasons ``baseline.yunchang.usp`` needs ``impls/baselines/yunchang_kernels.py``):

- ``AttnType.FA`` (the default): ``AssertionError: FlashAttention is not available``;
- ``TORCH_FLASH``, ``TORCH_EFFICIENT``: ``aten::_scaled_dot_product_flash_attention`` /
  ``_efficient_attention`` have no CPU kernel (``NotImplementedError``);
- ``TORCH_MATH``: the forward runs (a log-sum-exp of zeros, harmless on a ring of one), the
  backward raises ``RuntimeError: Not implemented backward for PyTorch attention types``
  (``yunchang.kernels.attention.pytorch_attn_backward`` raises on every device);
- ``ring_impl_type="basic_pytorch"`` always asks the flash kernel (as ``TORCH_FLASH``).

With the CPU block kernel shim, yunchang runs but its fp32 gradients are wrong, and a ring
of one fails on gloo: ``scripts/yunchang_fp32_repro.py``.

Run: ``python scripts/yunchang_cpu_check.py`` (one process, a gloo world of one).
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F


def _reference(q, k, v):
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                          v.transpose(1, 2), is_causal=True).transpose(1, 2)


def _attempt(impl: str, attn_type, backward: bool) -> str:
    from yunchang import LongContextAttention
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 8, 2, 4, requires_grad=True) for _ in range(3))
    try:
        out = LongContextAttention(ring_impl_type=impl, attn_type=attn_type)(q, k, v,
                                                                             causal=True)
        if backward:
            out.sum().backward()
    except Exception as e:  # noqa: BLE001 -- the finding is the error
        return f"FAIL {type(e).__name__}: {str(e).splitlines()[0][:110]}"
    return f"ok, max|out - sdpa| = {(out - _reference(q, k, v)).abs().max().item():.1e}"


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29637")
    dist.init_process_group("gloo", rank=0, world_size=1)
    from yunchang import set_seq_parallel_pg
    from yunchang.kernels import AttnType
    set_seq_parallel_pg(1, 1, 0, 1)
    kernels = (AttnType.FA, AttnType.TORCH_FLASH, AttnType.TORCH_EFFICIENT, AttnType.TORCH_MATH)
    runs = [("basic", a) for a in kernels] + [("basic_pytorch", AttnType.TORCH_MATH)]
    for impl, attn_type in runs:
        for backward in (False, True):
            what = "fwd+bwd" if backward else "fwd"
            print(f"{impl:13s} {attn_type.name:15s} {what:7s} "
                  f"{_attempt(impl, attn_type, backward)}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
