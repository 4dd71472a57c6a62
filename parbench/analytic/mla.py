"""Multi-head latent attention's parameter tensors (DeepSeek-V2, Sec. 2.1.2): the one
shape-level fact the parameter count, the FLOPs and the time model share."""
from __future__ import annotations

from .shape import Shape


def mla_linears(shape: Shape, tp: int = 1) -> list[tuple[str, int]]:
    """Multi-head latent attention's parameter tensors on one tensor-parallel rank
    (DeepSeek-V2, Sec. 2.1.2, Eqs. 9-17; Megatron-Core's ``MLASelfAttention``): the down
    projections to the latents and their RMSNorms whole on every rank (duplicated), the up
    projections to the heads column-parallel and the output projection row-parallel, split
    over t. With a query latent (``q_lora_rank`` = d_c'): h d_c', d_c' and
    d_c' a (d_qk + d_R); without: h a (d_qk + d_R). Keys and values: h (d_c + d_R), d_c,
    d_c a (d_qk + d_v); output a d_v h."""
    h, a, dc, dq = shape.h, shape.a, shape.kv_lora_rank, shape.q_lora_rank
    d_qk = (shape.qk_head_dim or shape.head_dim) + shape.qk_rope_head_dim
    d_v = shape.v_head_dim or shape.head_dim
    q = [("q_down", h * dq), ("q_norm", dq), ("q_up", dq * a * d_qk // tp)] if dq \
        else [("q_proj", h * a * d_qk // tp)]
    return q + [("kv_down", h * (dc + shape.qk_rope_head_dim)), ("kv_norm", dc),
                ("kv_up", dc * a * (d_qk - shape.qk_rope_head_dim + d_v) // tp),
                ("proj", a * d_v * h // tp)]


#: the tensors ``mla_linears`` names that every tensor-parallel rank holds whole
MLA_REPLICATED = ("q_down", "q_norm", "kv_down", "kv_norm")


def mla_replicated_params(shape: Shape) -> int:
    """Elements of one MLA layer that Megatron-Core duplicates on every tp rank: the down
    projections and the latents' RMSNorms (``MLA_REPLICATED``)."""
    return sum(n for name, n in mla_linears(shape) if name in MLA_REPLICATED)


def mla_tp_input_width(shape: Shape) -> int:
    """Elements per token whose gradient one tp rank all-reduces in the backward of an MLA
    layer (the conjugate ``f`` of Shoeybi et al. 2019, Sec. 3, moved past the replicated down
    projections): the up projections' inputs -- the normalised query latent d_c' (or h, the
    input of the column-parallel query projection when q_lora_rank = 0), the normalised K/V
    latent d_c -- and the shared rotary key d_R, every head of which on the rank adds to its
    gradient."""
    return (shape.q_lora_rank or shape.h) + shape.kv_lora_rank + shape.qk_rope_head_dim
