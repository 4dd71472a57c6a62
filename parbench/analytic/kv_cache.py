"""The KV cache of generation: 2 (K and V) x bytes x b x l x (h_kv d) x (s + n), per rank
under tp and pp (GQA: num_kv_heads heads)."""
from __future__ import annotations

from dataclasses import dataclass

from . import memory
from . import params as param_model
from .estimate_blocks import Block
from .gqa import check_query_groups, local_kv_heads
from .shape import (Shape, require_nonneg_int, require_positive_int)


@dataclass(frozen=True)
class KVCache(Block):
    """The KV cache of ``batch`` sequences: bytes in all and on the most loaded rank."""

    batch: int
    prompt_tokens: int
    generated_tokens: int
    num_kv_heads: int
    kv_hidden: int
    bytes_per_element: int
    total_bytes: int
    per_rank_bytes: int
    layers_per_rank: int
    formula: str = ("2 (K, V) x e x b x l x (num_kv_heads x head_dim) x (s + n); per rank "
                    "l / pp layers and max(num_kv_heads / tp, 1) heads")


def kv_cache(shape: Shape, batch: int, generate: int, *, prompt: int | None = None,
             tp: int = 1, pp: int = 1, vpp: int = 1, bytes_per_element: int = 2,
             ends: tuple[int, int] = (0, 0)) -> KVCache:
    """The KV cache of ``batch`` sequences of ``prompt`` (default ``seq_length``) tokens plus
    ``generate`` generated ones: 2 e b l h_kv (s + n) bytes (:func:`.memory.kv_cache_bytes`;
    4 b l h (s + n) in fp16 without GQA), and per rank: the K/V heads split over tp
    (Megatron-Core splits the query groups, so h_kv / t columns; with t > num_kv_heads one
    whole head, held by the t / num_kv_heads ranks of its group: :mod:`.gqa`), the layers
    over pp (the most loaded pipeline rank's layers; ``ends``: an uneven first / last rank's
    layers)."""
    require_positive_int("batch", batch)
    require_nonneg_int("generate", generate)
    s = shape.s if prompt is None else prompt
    require_positive_int("prompt", s)
    if not shape.mla:
        check_query_groups(shape, tp)
    layers_rank = max(len(ix) for ix in param_model.stage_layer_indices(
        shape.num_layers, pp, vpp, first=ends[0], last=ends[1]))
    e = bytes_per_element
    if shape.mla:
        # multi-head latent attention caches each token's K/V latent and its rotary key,
        # d_c + d_R elements a layer (DeepSeek-V2, Sec. 2.1.2 and Table 1), whole on every
        # tensor-parallel rank
        width = shape.kv_lora_rank + shape.qk_rope_head_dim
        total, per_rank = (e * batch * n * width * (s + generate)
                           for n in (shape.l, layers_rank))
    else:
        total = memory.kv_cache_bytes(batch, shape.l, shape.h, s, generate, e,
                                      shape.kv_hidden)
        per_rank = memory.kv_cache_bytes(batch, layers_rank, shape.h, s, generate, e,
                                         local_kv_heads(shape, tp) * shape.head_dim)
    extra = {"formula": "e x b x l x (kv_lora_rank + qk_rope_head_dim) x (s + n); per rank "
                        "l / pp layers, the latent whole"} if shape.mla else {}
    return KVCache(batch=batch, prompt_tokens=s, generated_tokens=generate,
                   num_kv_heads=shape.kv_heads, kv_hidden=shape.kv_hidden,
                   bytes_per_element=e, total_bytes=total, per_rank_bytes=per_rank,
                   layers_per_rank=layers_rank, **extra)
