"""Multi-head latent attention (DeepSeek-V2 Sec. 2.1.2, Eqs. 9-19; ``parbench.model.mla``)
under Megatron 1D tensor parallelism, as Megatron-Core's MLASelfAttention places it:

- the down projections (``q_down``, ``kv_down`` with the shared rotary key) and the latents'
  RMSNorms are duplicated on every tp rank (TE ``parallel_mode='duplicated'``);
- the up projections (``q_up`` or ``q_proj``, ``kv_up``) are column-parallel over heads (a
  contiguous block of rows is a block of heads: the rows are head-major), the output
  projection row-parallel over its a d_v input features.

The conjugate ``f`` (identity forward, all-reduce backward; Shoeybi et al. 2019, Sec. 3) sits
on the up projections' inputs -- the normalised query latent (or x when q_lora_rank = 0), the
normalised K/V latent -- and on the rotary key k_R, one all-reduce of their concatenation:
each rank's heads add only their share to the gradient of those inputs, so without it the
duplicated weights' gradients (and the layer's input gradient) would be partial. After it
they are whole and identical on every rank, as Megatron-Core's ColumnParallelLinear makes
them for its input (``copy_to_tensor_model_parallel_region``).

With sequence parallelism (Korthikanti et al. 2022) the duplicated layers run on the rank's
sequence shard and that concatenation is all-gathered along the sequence instead (reduce-
scattered backward); the duplicated weights' gradients are then partial over the sequence
and join the once-per-step all-reduce of the replicated parameters (Megatron-Core's
``sequence_parallel`` parameters, ``_allreduce_non_tensor_model_parallel_grads``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from parbench.model.mla import LATENT_EPS, MLADims, latent_heads
from parbench.model.packing import self_mask

from .collectives import CopyToRegion, GatherFromSequence
from .shards import blocks

#: column-parallel MLA weights (rows head by head)
UP_PROJECTIONS = ("q_up.weight", "q_proj.weight", "kv_up.weight")


def mla_rows(shape: tuple, tp: int):
    """Rank r's rows of an up projection: heads [r a/t, (r+1) a/t), a contiguous 1/t."""
    rows = shape[0] // tp
    return lambda r: (blocks(r * rows, rows), None)


def latents(model, x: torch.Tensor, pre: str, dims: MLADims):
    """The replicated part on x [s, b, h]: the query input (its normalised latent, or x),
    the normalised K/V latent and the rotary key, each whole on every rank."""
    p = model.p
    c = x
    if dims.q_rank:
        c = F.rms_norm(F.linear(x, p(f"{pre}.q_down.weight")), (dims.q_rank,),
                       p(f"{pre}.q_norm.weight"), eps=LATENT_EPS)
    kv = F.linear(x, p(f"{pre}.kv_down.weight"))
    latent, k_rope = kv.split([dims.kv_rank, dims.rope], dim=-1)
    latent = F.rms_norm(latent, (dims.kv_rank,), p(f"{pre}.kv_norm.weight"), eps=LATENT_EPS)
    return c, latent, k_rope


def mla_attention(model, x: torch.Tensor, i: int, docs=None) -> torch.Tensor:
    """Layer ``i``'s MLA on its normalised input x [s, b, h] (under sp the rank's sequence
    shard) on this rank's heads; the row-parallel projection reduces it (``model.row``)."""
    pre, dims = f"blocks.{i}.attn", MLADims.of(model.cfg)
    c, latent, k_rope = latents(model, x, pre, dims)
    widths = [c.shape[-1], dims.kv_rank, dims.rope]
    z = model.copy_to_heads(torch.cat([c, latent, k_rope], dim=-1))
    c, latent, k_rope = (t.transpose(0, 1) for t in z.split(widths, dim=-1))  # [b, s, .]
    q_name = "q_up" if dims.q_rank else "q_proj"
    q = F.linear(c, model.p(f"{pre}.{q_name}.weight"))
    kv = F.linear(latent, model.p(f"{pre}.kv_up.weight"))
    s = z.shape[0]  # the whole sequence (under sp gathered)
    pos = torch.arange(s, device=x.device) if docs is None else docs.pos
    q, k, v = latent_heads(q, kv, k_rope, model.heads, dims, pos, model.cfg.rope_theta)
    y = model.latent_core(q, k, v, dims, None if docs is None else self_mask(docs))
    y = y.permute(2, 0, 1, 3).reshape(s, x.shape[1], model.heads * dims.v)
    return model.row(y, model.p(f"{pre}.proj.weight"), None)


def copy_to_heads(x: torch.Tensor, group, sp_size: int = 1) -> torch.Tensor:
    """``f``: identity forward, all-reduce of the gradient backward; under sequence
    parallelism (``sp_size`` > 1) the all-gather of the sequence shards, reduce-scatter
    backward (Megatron-Core gathers the latents in its column-parallel up projections and
    the rotary key with gather_from_sequence_parallel_region)."""
    if sp_size > 1:
        return GatherFromSequence.apply(x, group, sp_size)
    return CopyToRegion.apply(x, group)
