"""The one CPU shim of ``baseline.yunchang.usp``: flash-attn's block kernel on CPU.

yunchang 0.6.4's ring attention (``yunchang.ring.ring_flash_attn`` / ``zigzag_ring_flash_attn``)
asks ``yunchang.kernels.select_flash_attn_impl(AttnType.FA, "fwd-only" | "bwd-only")`` for one
block's kernel, which is ``flash_attn_forward`` / ``flash_attn_backward``
(``yunchang/kernels/attention.py``): thin wrappers of flash-attn's ``_flash_attn_forward`` and
``_flash_attn_backward`` (Dao 2023, FlashAttention-2), CUDA only. On a CPU host none of
yunchang's kernels trains (``scripts/yunchang_cpu_check.py`` prints each failure):

- ``AttnType.FA``: ``AssertionError: FlashAttention is not available`` (no flash-attn);
- ``TORCH_FLASH`` / ``TORCH_EFFICIENT``: ``aten::_scaled_dot_product_flash_attention`` /
  ``_efficient_attention`` have no CPU kernel (``NotImplementedError``);
- ``TORCH_MATH``: forward only, with a log-sum-exp of zeros (so a ring of more than one rank
  merges blocks with wrong weights), and its backward, ``pytorch_attn_backward``, raises
  ``RuntimeError: Not implemented backward for PyTorch attention types`` on any device (so
  does ``ring_impl_type="basic_pytorch"``'s).

:func:`install_cpu_flash_kernels` points the two names that ``select_flash_attn_impl`` reads
(``yunchang.kernels.flash_attn_forward`` / ``flash_attn_backward``) at functions with
flash-attn's contract -- layout (b, s, heads, d), the block's log-sum-exp (b, heads, s)
returned; in backward the block's dq, dk, dv written into yunchang's buffers from the rows'
*final* output and log-sum-exp -- computed by torch's CPU flash-attention
(``aten._scaled_dot_product_flash_attention_for_cpu`` and its ``_backward``). Grouped-query
attention as flash-attn documents it: query head i reads K/V head i // (heads / kv_heads);
the kernel expands K/V to the query heads and sums dK/dV over each group. Everything else --
Ulysses all-to-alls, the ring's order, the causal block skipping, the merge
(``update_out_and_lse``), the gradient accumulation and its casts -- is yunchang's, unchanged.
Only with ``HAS_FLASH_ATTN`` false, i.e. never where flash-attn runs.
"""
from __future__ import annotations

import torch

_aten = torch.ops.aten


def _heads_first(t: torch.Tensor, group: int = 1) -> torch.Tensor:
    """(b, s, heads, d) -> (b, heads * group, s, d): K/V heads repeated for their queries."""
    t = t.transpose(1, 2)
    return t.repeat_interleave(group, dim=1) if group > 1 else t


def _group(q: torch.Tensor, k: torch.Tensor) -> int:
    heads, kv = q.shape[2], k.shape[2]
    if heads % kv:
        raise ValueError(f"{kv} K/V heads do not divide {heads} query heads")
    return heads // kv


def cpu_flash_forward(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                      window_size=(-1, -1), softcap=None, alibi_slopes=None,
                      return_softmax=False):
    """flash-attn's forward contract: (out (b, s, heads, d), lse (b, heads, s))."""
    _refuse(dropout_p, window_size, softcap, alibi_slopes)
    g = _group(q, k)
    out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
        _heads_first(q), _heads_first(k, g), _heads_first(v, g), 0.0, causal,
        scale=softmax_scale)
    return out.transpose(1, 2), lse


def cpu_flash_backward(dout, q, k, v, out, softmax_lse, block_dq_buffer, block_dk_buffer,
                       block_dv_buffer, dropout_p, softmax_scale, bwd_causal, window_size,
                       softcap, alibi_slopes, deterministic, rng_state=None):
    """flash-attn's backward contract: dq, dk, dv of the block written into the buffers."""
    _refuse(dropout_p, window_size, softcap, alibi_slopes)
    g = _group(q, k)
    dq, dk, dv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
        _heads_first(dout).contiguous(), _heads_first(q), _heads_first(k, g),
        _heads_first(v, g), _heads_first(out), softmax_lse.contiguous(), 0.0, bwd_causal,
        scale=softmax_scale)
    b, kv, s, d = k.shape[0], k.shape[2], k.shape[1], k.shape[3]
    block_dq_buffer.copy_(dq.transpose(1, 2))
    block_dk_buffer.copy_(dk.reshape(b, kv, g, s, d).sum(2).transpose(1, 2))
    block_dv_buffer.copy_(dv.reshape(b, kv, g, s, d).sum(2).transpose(1, 2))


def _refuse(dropout_p, window_size, softcap, alibi_slopes) -> None:
    """What the baseline never asks for (no dropout, window, softcap or ALiBi)."""
    if dropout_p or tuple(window_size) != (-1, -1) or softcap or alibi_slopes is not None:
        raise NotImplementedError("the CPU block kernel runs plain causal/full attention")


def install_cpu_flash_kernels() -> bool:
    """Point yunchang's flash-attn block kernels at the CPU ones where flash-attn is absent;
    returns whether it did (idempotent)."""
    import yunchang.kernels as yk
    from yunchang.globals import HAS_FLASH_ATTN
    if HAS_FLASH_ATTN:
        return False
    yk.flash_attn_forward = cpu_flash_forward
    yk.flash_attn_backward = cpu_flash_backward
    return True
