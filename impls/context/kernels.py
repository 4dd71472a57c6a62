"""The blockwise attention kernel every context-parallel core is built from, and the merge.

``attn_forward(q, k, v, causal)`` returns the block's output and its log-sum-exp per query
row; ``attn_backward`` returns dQ, dK, dV of the block given the *final* output and
log-sum-exp of the rows (FlashAttention-2's backward, Dao 2023, Alg. 2: P = exp(S - lse) and
D = rowsum(dO * O) need only the final row statistics, so every block's gradient is exact
without recomputing the merge). ``merge`` is the online-softmax combination of two partial
results (Milakov & Gimelshein 2018; Liu et al. 2023, Sec. 3): rows rescaled by
exp(lse_i - lse) with lse = log(exp lse_1 + exp lse_2).

On CPU the kernels are ATen's fused flash attention for CPU
(``_scaled_dot_product_flash_attention_for_cpu`` and its backward, the kernel
``F.scaled_dot_product_attention`` itself runs on CPU); elsewhere an explicit fp32 reference
(``math_forward`` / ``math_backward``) is used. Tensors are (b, heads, n, d); ``causal`` is
top-left aligned (key index <= query index); ``mask`` is a boolean (n_q, n_k) "may attend"
(or (b, 1, n_q, n_k): packed documents, ``parbench.model.packing.allowed``).

A block in which a query row may attend to no key (a packed document that starts after the
block's keys) contributes nothing to that row: its output is 0 and its log-sum-exp -inf
(``_empty_rows``; ATen's CPU flash kernel reports 0 there, as if one key of score 0 had been
seen), so that ``merge`` weights it exp(-inf) = 0. The backward needs no care: it uses the
row's final log-sum-exp, finite (every row attends to its own token), so P = exp(-inf - lse)
= 0 on the empty row.
"""
from __future__ import annotations

import math

import torch

_aten = torch.ops.aten


def _scale(q: torch.Tensor) -> float:
    return 1.0 / math.sqrt(q.shape[-1])


def _additive(mask: torch.Tensor, dtype) -> torch.Tensor:
    out = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return out.masked_fill_(~mask, float("-inf"))


def query_group(q, k) -> int:
    """Query heads per K/V head (grouped-query attention, Ainslie et al. 2023): K and V of
    ``k.shape[1]`` heads each serve that many consecutive query heads."""
    g, rest = divmod(q.shape[1], k.shape[1])
    if rest:
        raise ValueError(f"{k.shape[1]} K/V heads do not divide {q.shape[1]} query heads")
    return g


def _expand(t: torch.Tensor, g: int) -> torch.Tensor:
    return t if g == 1 else t.repeat_interleave(g, dim=1)


def fold_group(dt: torch.Tensor, g: int) -> torch.Tensor:
    """The gradient of ``_expand``: each K/V head's copies summed."""
    if g == 1:
        return dt
    b, heads, n, d = dt.shape
    return dt.view(b, heads // g, g, n, d).sum(2)


def attn_forward(q, k, v, causal: bool = False, mask: torch.Tensor | None = None):
    """(output, log-sum-exp) of softmax(q k^T / sqrt(d)) v over one block; K and V may hold
    fewer heads than Q (grouped-query attention: each serves its group of query heads), so
    that the cores move K/V blocks of the K/V heads only."""
    g = query_group(q, k)
    k, v = _expand(k, g), _expand(v, g)
    if q.device.type == "cpu":
        add = None if mask is None else _additive(mask, q.dtype)
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=add, scale=_scale(q))
        return _empty_rows(out, lse, mask)
    return math_forward(q, k, v, causal, mask)


def _empty_rows(out: torch.Tensor, lse: torch.Tensor, mask):
    """``out`` 0 and ``lse`` -inf on the rows ``mask`` lets attend to no key (module
    docstring): what the block contributes to them is nothing."""
    if mask is None:
        return out, lse
    empty = (~mask.any(-1)).expand(lse.shape)  # mask rows (n_q,) or (b, 1, n_q)
    return out.masked_fill(empty.unsqueeze(-1), 0.0), lse.masked_fill(empty, float("-inf"))


def attn_backward(dout, q, k, v, out, lse, causal: bool = False,
                  mask: torch.Tensor | None = None):
    """(dq, dk, dv) of one block given the rows' final output and log-sum-exp; dk and dv of
    grouped K/V heads summed over each head's query group."""
    g = query_group(q, k)
    k, v = _expand(k, g), _expand(v, g)
    if q.device.type == "cpu":
        add = None if mask is None else _additive(mask, q.dtype)
        dq, dk, dv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(),
            out.contiguous(), lse.contiguous(), 0.0, causal, attn_mask=add, scale=_scale(q))
    else:
        dq, dk, dv = math_backward(dout, q, k, v, out, lse, causal, mask)
    return dq, fold_group(dk, g), fold_group(dv, g)


def _allowed(nq: int, nk: int, causal: bool, mask, device):
    if mask is not None:
        return mask
    if causal:
        return torch.ones(nq, nk, dtype=torch.bool, device=device).tril()
    return None


def math_forward(q, k, v, causal: bool = False, mask=None):
    s = (q.float() @ k.float().transpose(-1, -2)) * _scale(q)
    allowed = _allowed(q.shape[-2], k.shape[-2], causal, mask, q.device)
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - _finite(lse).unsqueeze(-1))  # a row with no key: p = 0, lse = -inf
    return (p @ v.float()).to(q.dtype), lse


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with -inf (a row with nothing to attend to) as 0, for exp(s - lse)."""
    return lse.masked_fill(lse == float("-inf"), 0.0)


def math_backward(dout, q, k, v, out, lse, causal: bool = False, mask=None):
    scale = _scale(q)
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    allowed = _allowed(q.shape[-2], k.shape[-2], causal, mask, q.device)
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    p = torch.exp(s - lse.unsqueeze(-1))
    do = dout.float()
    dv = p.transpose(-1, -2) @ do
    dp = do @ v.float().transpose(-1, -2)
    d = (do * out.float()).sum(-1, keepdim=True)
    ds = p * (dp - d) * scale
    return (ds @ k.float()).to(q.dtype), (ds.transpose(-1, -2) @ q.float()).to(k.dtype), \
        dv.to(v.dtype)


def merge(out: torch.Tensor, lse: torch.Tensor, blk_out: torch.Tensor,
          blk_lse: torch.Tensor) -> None:
    """Fold a block's (output, log-sum-exp) into the running ones, in place (rows of ``out``:
    (b, h, n, d); ``lse``: (b, h, n)). Starting from lse = -inf and out = 0 gives the block.
    A block row with lse -inf (nothing attended) leaves the row as it is; a row that has seen
    nothing on either side stays 0 and -inf (exp(-inf - 0), never exp(-inf + inf))."""
    new = torch.logaddexp(lse, blk_lse)
    ref = _finite(new)
    out.mul_(torch.exp(lse - ref).unsqueeze(-1))
    out.add_(blk_out * torch.exp(blk_lse - ref).unsqueeze(-1))
    lse.copy_(new)
