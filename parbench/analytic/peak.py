"""The analytic peak memory of a rank: model states plus the activations alive at peak.

``case`` is any object with ``model``, ``parallel`` and ``run`` sections (a ``CaseConfig``).

Activations per layer follow Korthikanti et al. 2022 (Eqs. 1-2, Table 2) adapted to the
reference model (``analytic.reference_layer_activation_bytes``: fp32, no dropout, fused
attention, the norms' statistics; the LLaMA blocks' RoPE, K/V repeat, SwiGLU and RMSNorm
tensors, ``reference_block_keywords``); the embedding output and, on the rank holding the head, the
logits and their log-softmax (2 x b s V elements) are added. A data-parallel rank runs its
micro-batches one after another, so one micro-batch of every layer is alive at the end of a
forward. Not counted: temporaries of backward, communication buffers, gathered ZeRO-3 units
and allocator rounding -- the measured peak is expected above this figure.
"""
from __future__ import annotations

from .activations import reference_block_keywords, reference_layer_activation_bytes
from .shape import shape_from


def activation_bytes(case, layers: int, num_microbatches: int = 1,
                     embedding: bool = True, head: bool = True) -> float:
    m, p = case.model, case.layout
    e = 2 if case.run.dtype == "bf16" else 4
    b, s, h = p.micro_batch_size, m.seq_length, m.hidden_size
    per_layer = reference_layer_activation_bytes(s, b, h, m.num_heads,
                                                 ffn_hidden=shape_from(m).f,
                                                 bytes_per_element=e,
                                                 **reference_block_keywords(m, 1, b))
    total = per_layer * layers
    if embedding:
        total += b * s * h * e
    if head:
        total += 2 * b * s * m.vocab_size * 4  # logits and log-softmax, fp32 loss
    return total * num_microbatches


def predicted_peak(case, family: str, model_states: dict | None) -> float | None:
    """Per-rank analytic peak for the data-parallel family (None where not modelled)."""
    if family != "data" or not model_states:
        return None
    return sum(model_states.values()) + activation_bytes(case, case.model.num_layers)
