"""One MoE layer's activation bytes on one rank (:func:`moe_layer_activation_bytes`): the
dense layer's count with its MLP replaced by the routed path, term by term.

Derivation, per rank and micro-batch, e = ``bytes_per_element``, T = ``tokens`` the rank
routes (its b s/cp, / t under sequence parallelism), E experts, k = moe_top_k,
C = ``shape.expert_capacity(T, E, k, cf)``:

- **Dense terms stay** (Korthikanti et al. 2022, Sec. 4.1, Table 2): the LayerNorm
  inputs, the attention block, the LN2 output (the dense fc1 input; here the router's and
  the dispatch's input, the same tensor) and the MLP's dropout mask. The dense MLP's
  fc1 output and GeLU output (Korthikanti's "8 + 8" for f = 4h), 2 s b f e / t bytes, are
  what the routed path replaces (``dense_mlp_replaced``, negative).
- **Router**: logits and probabilities, T x E each, fp32 (the router runs in fp32; the
  softmax keeps its output, the z-loss's logsumexp its input, ``parbench.model.moe.route``):
  2 x 4 T E bytes.
- **Dispatch buffer** (GShard, Lepikhin et al. 2020, Sec. 2.2 and Algorithm 2; Switch,
  Fedus et al. 2021, Sec. 2.2: a fixed ``[E, C, h]`` buffer, a dropped token's slot left
  as padding): every rank of the ep group sends each expert C slots, so after the
  all-to-all a rank holds, for each of its E/ep experts, C rows from each of the ep
  source ranks -- ep C rows per local expert, (E/ep) ep C = E C rows in all, padding
  included. Without a capacity limit a rank sends its k T routed copies, and under
  balanced routing receives as many (the exact count depends on the routing; k T is its
  mean over the ep ranks). R = ``rows`` = E C or k T rows of h: the experts' fc1 input,
  R h e.
- **Expert MLPs**: Korthikanti's fc1 output and GeLU output on the R received rows
  instead of s b, each expert's f split over ``etp``: 2 R f e / etp (3 R f e / etp for
  ``mlp="swiglu"``, as for the dense MLP; the replaced dense term is 3 s b f e / t too).
- **Combine buffer**: the expert outputs the combine all-to-all brings back, R rows of h,
  kept by the gate multiplication for the gates' gradient: R h e.
- Fine-grained and shared experts (DeepSeekMoE, Dai et al. 2024): the expert MLPs'
  terms at each routed expert's hidden size ``expert_f`` (default f); the shared
  experts, one MLP of hidden size ``shared_f`` on the layer's s b tokens split over tp
  like the dense MLP, keep the dense MLP's terms at that width, k s b shared_f e / t.

Not counted: the gates and expert indices (T k values each), the all-to-all send buffers
(an all-to-all keeps nothing for backward) and any gather of the routed tokens over
the etp ranks (not in the communication count either). Full recomputation keeps only the
layer input, as for a dense layer: every routed term is 0.

Selective recomputation of MoE submodules (``modules``, Megatron-Core's names): ``moe``
(the whole layer checkpointed at its input) keeps no routed term; ``moe_act`` (the
experts' activation recomputed, output-discarding) keeps the experts' fc1 output but not
the activation's (expert_mlp: 1 of GeLU's 2, 2 of SwiGLU's 3 widths); ``shared_experts``
keeps none of the shared MLP's. ``mlp`` recomputes dense MLPs only: ``dense_layer`` was
counted without them then, so nothing is replaced.
"""
from __future__ import annotations


def moe_layer_activation_bytes(dense_layer: float, *, s: int, b: int, h: int, f: int,
                               tp: int, tokens: int, rows: int, num_experts: int,
                               etp: int = 1, recompute: str = "none",
                               bytes_per_element: int = 2,
                               mlp: str = "gelu", expert_f: int | None = None,
                               shared_f: int = 0,
                               modules: frozenset[str] = frozenset({"core_attn"})
                               ) -> dict[str, float]:
    """Activation bytes one MoE layer keeps for backward on one rank, by term (module doc for
    the derivation), given the same layer's count as a dense layer, ``dense_layer``
    (``activations.layer_activation_bytes`` or ``reference_layer_activation_bytes`` at the
    same s = s/cp, b, t, sp and recompute); ``modules``: what ``recompute="selective"``
    recomputes (module doc)."""
    k = 3 if mlp == "swiglu" else 2
    terms = _routed_terms(k, s * b, h, f, tp, tokens, rows, num_experts, etp,
                          bytes_per_element, f if expert_f is None else expert_f, shared_f)
    if recompute == "full":
        terms = dict.fromkeys(terms, 0)
    elif recompute == "selective":
        terms = _selective_moe(terms, modules, k)
    return {"dense_layer": dense_layer, **terms,
            "total": dense_layer + sum(terms.values())}


def _selective_moe(terms: dict, modules: frozenset[str], k: int) -> dict:
    """The routed terms of :func:`moe_layer_activation_bytes` under selective recomputation
    of ``modules``."""
    if "moe" in modules:
        terms = {name: (v if name == "dense_mlp_replaced" else 0) for name, v in terms.items()}
    if "moe_act" in modules:
        terms["expert_mlp"] *= (k - 1) / k
    if "shared_experts" in modules and "shared_mlp" in terms:
        terms["shared_mlp"] = 0
    if "mlp" in modules:
        terms["dense_mlp_replaced"] = 0
    return terms


def _routed_terms(k: int, sb: int, h: int, f: int, tp: int, tokens: int, rows: int,
                  num_experts: int, etp: int, e: int, fe: int, shared_f: int) -> dict:
    """The terms of :func:`moe_layer_activation_bytes` without recomputation."""
    terms = {"dense_mlp_replaced": -k * sb * f * e / tp,
             "router": 2 * 4 * tokens * num_experts,
             "dispatch": rows * h * e,
             "expert_mlp": k * rows * fe * e / etp,
             "combine": rows * h * e}
    if shared_f:
        terms["shared_mlp"] = k * sb * shared_f * e / tp
    return terms
