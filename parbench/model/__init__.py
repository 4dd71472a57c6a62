"""The reference model: the GPT decoder every scheme partitions and the golden run trains
whole, its deterministic initialisation and synthetic data.

``blocks`` (embeddings, attention, MLP, norms and the LM head), ``moe`` (the mixture of
experts: router, capacity, dropping, auxiliary losses), ``gpt`` (the assembly: pre-LN layers,
stages), ``init`` (seeded per-parameter initialisation), ``data`` (synthetic batches) and
``packing`` (documents packed into a sample), ``training`` (the optimizer and compute dtype every scheme and the golden run use).
"""
from .blocks import MLP, Attention, Embedding, Head
from .data import IGNORE_INDEX, counted_tokens, mask_prompts, synthetic_batch
from .gpt import Block, GPTStage, build_model, build_stage, stage_layers
from .init import init_parameters, param_seed
from .packing import Documents, documents, documents_of, eod_token, pack_batch
from .training import (clip_coefficient, clip_local_, compute_dtype, grad_norm_sq,
                       make_optimizer, scale_grads_)

__all__ = ["Attention", "Block", "Documents", "Embedding", "GPTStage", "Head", "MLP",
           "build_model", "documents", "documents_of", "eod_token", "pack_batch",
           "build_stage", "clip_coefficient", "clip_local_", "compute_dtype", "grad_norm_sq",
           "scale_grads_", "IGNORE_INDEX", "counted_tokens", "mask_prompts", "init_parameters", "make_optimizer", "param_seed",
           "stage_layers", "synthetic_batch"]
