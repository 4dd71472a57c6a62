"""Activation memory per transformer layer and per pipeline stage.

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
Sec. 4 and Table 2. For sequence length s, micro-batch b, hidden h, a heads, tensor-parallel
size t, 16-bit activations and 1-byte dropout masks, the bytes one layer saves for backward:

    no parallelism (Eq. 1)         sbh (34 + 5as/h)
    tensor parallel (Eq. 2)        sbh (10 + 24/t + 5as/(ht))
    tensor + sequence parallel     sbh/t (34 + 5as/h)            (Eq. 3)
    selective recomputation        sbh (10 + 24/t)   or 34 sbh/t with sequence parallelism
    full recomputation             2 sbh

The 34 is: attention block 11 (QKV input 2, Q and K 4, V 2, projection input 2, dropout
mask 1), MLP 19 (fc1 input 2, GeLU input 8, fc2 input 8, dropout mask 1), two LayerNorm
inputs 4; the 5as/h is the s x s score matrices (softmax output 2, dropout mask 1, dropout
output 2). Of the 34, 10 (LayerNorm inputs, QKV and fc1 inputs, dropout masks) is replicated
over the tensor-parallel ranks unless sequence parallelism shards it.

:func:`layer_activation_bytes` generalises the count to e bytes per stored element, m bytes
per mask element, any f (the 8 + 8 of the MLP are 2f/h each of fc1 output and GeLU output
in e bytes) and with or without dropout; with the paper's defaults it gives the formulas
above exactly. :func:`reference_layer_activation_bytes` applies it to parbench's reference
model -- see its docstring for the assumptions.

Attention implementation (``attention=``): ``"eager"`` (the paper's count) keeps the s x s
score matrices -- the 5as^2b term: softmax output 2, dropout mask 1, dropout output 2 bytes
per score. ``"flash"`` (FlashAttention, Dao et al. 2022, Sec. 3.1: the scores are recomputed
in backward from Q, K, V, the output and the per-row softmax statistics) keeps no s x s
tensor: the 5as^2b term is gone, and the kernel's output (sbh elements) and its
log-sum-exp (a s b fp32 values) are kept instead.

Grouped-query attention and SwiGLU (analytic-only shapes): K and V are s b h_kv each
(h_kv = num_kv_heads x head size) instead of s b h, so Korthikanti's "Q and K 4, V 2" becomes
2sbh + 4 s b h_kv; a SwiGLU MLP keeps its 2f-wide gate-and-up output (the SwiGLU input,
Megatron-Core's fused ``bias_swiglu`` saves it and recomputes the SiLU in backward) and the
f-wide product (the down projection's input): 3 s b f elements instead of GeLU's 2 s b f.

The LLaMA blocks as parbench's reference model keeps them: the keywords of
:func:`reference_layer_activation_bytes` (:func:`reference_block_keywords` gives a model's),
built from the per-feature terms :func:`qkv_saved_elements`, :func:`rope_table_bytes`,
:func:`mlp_saved_elements` and :func:`norm_saved_bytes` (the first three shared with the 2D /
2.5D / 3D grids' forms, ``tensor_grid``); each term is read off the model's code
(``parbench.model.blocks``), the saved-tensor hooks' measurement being the check.
``norm="rmsnorm"`` (:func:`norm_saved_bytes`);
``mlp="swiglu"`` keeps silu(gate) besides Korthikanti's gate/up and product
(:func:`mlp_saved_elements`: 4 s b f / t, not the 3 of Megatron-Core's fused kernel);
Q, K and V as :func:`qkv_saved_elements` counts them (``rope``: q and k rotated;
``kv_repeat``: K/V repeated over their query groups before the kernel;
``kernel_copies``: the kernel keeps contiguous copies) in place of the QKV output, and
RoPE's cos / sin tables (:func:`rope_table_bytes` at ``rope_rows``, default s; not
divided by t: every rank rotates its heads with whole tables). Selective recomputation
of the core keeps the core's inputs: the QKV output when RoPE is recomputed with the
core (``rope_recomputed``, Megatron 1D), rotated q and k and the tables when the core
is checkpointed after RoPE (the context family). ``attn_mask``: packed documents' mask,
kept by the kernel (:func:`packed_mask_bytes`) on every rank unless the core is
recomputed.

The logits (:func:`logits_bytes`) are not part of a layer: the last pipeline stage keeps the
fp32 logits of its micro-batch for the cross-entropy backward, 4 s b V / t bytes
(Korthikanti et al. 2022, Sec. 4.3; Megatron-LM ``theoretical_memory_usage.py``).
"""
from __future__ import annotations

# the MoE layer's count (its own module), read by callers as activations.moe_layer_activation_bytes
from .activations_moe import moe_layer_activation_bytes  # noqa: F401
from .shape import require_positive_int

RECOMPUTE = ("none", "selective", "full")
ATTENTION = ("eager", "flash")


def layer_activation_bytes(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False,
                           recompute: str = "none", ffn_hidden: int | None = None,
                           bytes_per_element: int = 2, mask_bytes: int = 1,
                           dropout: bool = True, attention: str = "eager",
                           kv_hidden: int | None = None, mlp: str = "gelu",
                           widths: tuple[int, int, int, int] | None = None,
                           latent: int = 0,
                           modules: frozenset[str] = frozenset({"core_attn"})) -> float:
    """Activation bytes one transformer layer keeps for backward, per tensor-parallel rank.

    ``attention="eager"`` stores the s x s score matrices (softmax output, and with dropout
    its mask and output); ``"flash"`` (a fused kernel that recomputes scores in backward)
    instead stores the attention output (sbh elements) and a per-row log-sum-exp
    (a s b values, fp32). Full recomputation keeps only the layer input -- 2sbh in Table 2;
    with sequence parallelism that input is the sequence shard, so it is divided by t.
    ``kv_hidden`` (default h) is the width of K and V under grouped-query attention;
    ``mlp="swiglu"`` keeps 3 s b f elements of the MLP instead of 2 s b f (module doc).
    ``widths``: the (Q, K, V, output) widths over all heads when they are not (h, h_kv, h_kv,
    h) -- multi-head latent attention's (``Shape.attention_widths``); ``latent``: elements
    per token kept whole on every tensor-parallel rank besides (MLA's query and K/V latents,
    each as its norm's input and the up projection's input, and the rotary key).
    ``modules``: what ``recompute="selective"`` recomputes (:func:`selective_savings`;
    Korthikanti's selective recomputation is ``core_attn``, the default).
    """
    for name, v in (("s", s), ("b", b), ("h", h), ("a", a), ("t", t)):
        require_positive_int(name, v)
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute={recompute!r} must be one of {', '.join(RECOMPUTE)}")
    if attention not in ATTENTION:
        raise ValueError(f"attention={attention!r} must be one of {', '.join(ATTENTION)}")
    if mlp not in ("gelu", "swiglu"):
        raise ValueError(f"mlp={mlp!r} must be one of gelu, swiglu")
    e, m, d = bytes_per_element, mask_bytes, int(dropout)
    f = 4 * h if ffn_hidden is None else ffn_hidden
    kv = h if kv_hidden is None else kv_hidden
    q_w, k_w, v_w, o_w = widths or (h, kv, kv, h)
    sbh = s * b * h
    if recompute == "full":
        return e * sbh / (t if sp else 1)
    # LN1 and LN2 inputs, QKV input, fc1 input, two dropout masks: replicated under TP
    replicated = sbh * (4 * e + 2 * d * m)
    # Q, K, V, projection input, fc1 output (GeLU input), GeLU output (fc2 input); SwiGLU:
    # gate and up outputs (2f) and their product (f)
    mlp_tensors = 3 if mlp == "swiglu" else 2
    split = ((q_w + k_w + v_w + o_w) * s * b + mlp_tensors * s * b * f) * e
    if attention == "eager":
        scores = a * s * s * b * (e + d * (m + e))
    else:
        scores = s * b * o_w * e + a * s * b * 4
    if recompute == "selective":
        kept = selective_savings(modules, s * b, e, h, (q_w, k_w, v_w), mlp_tensors * f,
                                 widths is not None)
        replicated -= kept["layernorm"]
        split -= kept["mla_up_proj"] + kept["mlp"]
        scores = 0 if "core_attn" in modules else scores
    return replicated / (t if sp else 1) + latent * s * b * e + (split + scores) / t


def selective_savings(modules: frozenset[str], tokens: int, e: int, h: int,
                      qkv: tuple[int, int, int], mlp_width: int, mla: bool) -> dict:
    """The elements x e bytes a dense layer stops keeping for each submodule that selective
    recomputation recomputes (Megatron-Core's ``recompute_modules``; the attention core,
    ``core_attn``, drops the score terms in :func:`layer_activation_bytes` itself):

    - ``layernorm`` (output-discarding: the input and pre-MLP norms' outputs are recomputed
      from their inputs, which the residual keeps): the QKV and fc1 inputs, 2 s b h;
    - ``mla_up_proj`` (output-discarding: MLA's up projections and RoPE recomputed from the
      latents, which stay): Q, K and V, s b (w_q + w_k + w_v); multi-head latent attention
      only (Megatron refuses it otherwise);
    - ``mlp`` (the dense MLP checkpointed at its input): its fc1 output and activation
      output (GeLU 2 s b f, SwiGLU 3 s b f).

    Before tensor-parallel division (the caller divides as the tensors are split); the MoE
    modules are :func:`moe_layer_activation_bytes`' terms."""
    if "mla_up_proj" in modules and not mla:
        raise ValueError("recompute_modules=mla_up_proj needs multi-head latent attention "
                         "(Megatron refuses it otherwise)")
    return {"layernorm": 2 * tokens * h * e if "layernorm" in modules else 0,
            "mla_up_proj": sum(qkv) * tokens * e if "mla_up_proj" in modules else 0,
            "mlp": mlp_width * tokens * e if "mlp" in modules else 0}


NORMS = ("layernorm", "rmsnorm")


def qkv_saved_elements(tokens, h, kv, *, rope: bool = False, repeat: bool = False,
                       copies: bool = False):
    """Elements of Q, K and V kept for backward on ``tokens`` tokens, Q of width ``h`` and K, V
    of width ``kv`` (the heads a rank attends with; Korthikanti et al.'s "Q and K 4, V 2"
    at GQA's narrower K/V).

    The attention kernel keeps the tensors it is given. ``copies``: it makes them contiguous
    first (the context cores), so it keeps its own Q, K, V, h + 2 kv per token, whatever
    came before. Otherwise (the reference model's ``split_heads``, Megatron 1D, the grids)
    each of q, k, v is a view of the fused QKV output unless an op made it its own tensor:
    RoPE (Su et al. 2021, Eq. 34; ``blocks.rotate``) rotates q and k into new tensors of h and
    kv; grouped-query attention's ``repeat_interleave`` (``repeat``: Ainslie et al. 2023,
    each K/V head repeated over its query group before the kernel) makes k and v new tensors
    of width h. The QKV output, h + 2 kv per token, is kept once if any of them is a view.
    GPT-2 blocks: h + 2 kv either way."""
    if copies:
        return tokens * (h + 2 * kv)
    kv_own = h if repeat else kv
    own = {"q": h if rope else 0, "k": kv_own if (rope or repeat) else 0,
           "v": kv_own if repeat else 0}
    views = not (rope and repeat)  # v is a view unless repeated, q unless rotated
    return tokens * ((h + 2 * kv) * views + sum(own.values()))


def rope_table_bytes(rows: int, head_dim: int) -> int:
    """RoPE's tables kept for backward: ``blocks.rotate`` multiplies the heads by cos and
    sin of [rows, head_dim] fp32 (``x * cos`` keeps cos, ``half * sin`` keeps sin: the tables
    need no gradient) and is called for q and for k: 4 tables, 4 rows d x 4 bytes. ``rows``:
    the positions rotated at -- s whole sequences (the tables broadcast over the batch), b s
    when packed documents give every sample its own positions."""
    return 4 * rows * head_dim * 4


def packed_mask_bytes(b, s: int):
    """Packed documents' mask as ``scaled_dot_product_attention`` keeps it: the boolean
    "causal and same document" mask (``packing.self_mask``, [b, 1, s, s]) is turned by the
    CPU kernel into an additive fp32 mask of that shape and saved for backward, 4 b s^2
    bytes whatever the heads (it broadcasts over them)."""
    return 4 * b * s * s


def mlp_saved_elements(f, mlp: str = "gelu", fc2_input_kept: bool = True):
    """Elements per token the MLP's activation keeps of its f hidden features
    (``blocks.mlp_activation``): GELU its input (fc1's output) and, where fc2 keeps its input,
    GELU's output, 2f (Korthikanti's 8 + 8 at f = 4h); SwiGLU (Shazeer 2020, Eq. 6) fc1's
    [gate; up] output (2f: ``silu(gate)`` keeps gate, the product keeps up, both views of
    it), ``silu(gate)`` (f, the product keeps it) and, where fc2 keeps it, the product (f):
    4f. ``fc2_input_kept=False``: fc2 keeps another tensor (3D's gathered input)."""
    if mlp not in ("gelu", "swiglu"):
        raise ValueError(f"mlp={mlp!r} must be one of gelu, swiglu")
    return f * ((3 if mlp == "swiglu" else 1) + int(fc2_input_kept))


def norm_saved_bytes(tokens, h, norm: str = "layernorm", e: int = 4):
    """Bytes one of torch's norms keeps for backward on ``tokens`` rows of h, its output (the
    next linear's input) not counted: ``F.layer_norm`` keeps its input and the per-row mean and
    1/sigma (fp32), T h e + 8 T; ``F.rms_norm`` (Zhang & Sennrich 2019, Eq. 4) is composite on
    CPU (torch 2.13): x^2's ``pow`` and ``x * rstd`` keep x, ``rsqrt`` its result 1/rms (fp32,
    shared with the product), and ``(x * rstd) * weight`` the normalised x -- 2 T h e + 4 T.
    (A fused RMSNorm kernel would keep x and 1/rms only.)"""
    if norm not in NORMS:
        raise ValueError(f"norm={norm!r} must be one of {', '.join(NORMS)}")
    if norm == "rmsnorm":
        return 2 * tokens * h * e + 4 * tokens
    return tokens * h * e + 8 * tokens


def reference_block_keywords(m, tp: int = 1, b: int = 1) -> dict:
    """The LLaMA-block keywords of :func:`reference_layer_activation_bytes` for a model config
    ``m`` (its K/V width, MLP, norm, RoPE) whose attention repeats K/V over the query groups
    before the kernel, as the reference model does. ``tp``: a Megatron 1D rank's a/t query
    heads attend with max(g/t, 1) K/V heads -- with t > g the rank takes its group's one
    K/V head from the gathered QKV output, Megatron-Core building the core with t query
    groups (``impls.tensor.gqa``) -- so K/V are max(g, t) d wide before the split and
    repeated when a > max(g, t). RoPE rotates at the s positions of whole sequences, or at
    each of the b samples' own (``rope_rows`` b s) when documents are packed (``pack_docs``:
    ``Documents.pos`` is [b, s]) and the kernel keeps their mask (``attn_mask``).
    Multi-head latent attention (``kv_lora_rank``) has its own
    widths: no keywords (the GPT-2 count)."""
    if getattr(m, "kv_lora_rank", 0):
        return {}
    g = max(m.num_kv_heads or m.num_heads, tp)
    return {"kv_hidden": g * m.head_dim, "mlp": m.mlp, "norm": m.norm,
            "rope": bool(m.rope_theta), "kv_repeat": g < m.num_heads,
            "rope_rows": m.seq_length * (b if m.pack_docs else 1),
            "attn_mask": bool(m.pack_docs)}


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False,
                            recompute: str = "none") -> float:
    """The paper's formulas verbatim (Table 2), for checking the generalisation."""
    if recompute == "full":
        return 2 * s * b * h
    if recompute == "selective":
        return s * b * h * (34 / t if sp else 10 + 24 / t)
    if sp:
        return s * b * h / t * (34 + 5 * a * s / h)
    return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))


def reference_layer_activation_bytes(s: int, b: int, h: int, a: int, t: int = 1,
                                     sp: bool = False, recompute: str = "none",
                                     ffn_hidden: int | None = None,
                                     bytes_per_element: int = 4,
                                     proj_input_copy: bool = True,
                                     kv_hidden: int | None = None,
                                     mlp: str = "gelu",
                                     widths: tuple[int, int, int, int] | None = None,
                                     latent: int = 0,
                                     modules: frozenset[str] = frozenset({"core_attn"}),
                                     *, norm: str = "layernorm", rope: bool = False,
                                     kv_repeat: bool = False, kernel_copies: bool = False,
                                     rope_recomputed: bool = True,
                                     rope_rows: int | None = None,
                                     attn_mask: bool = False) -> float:
    """:func:`layer_activation_bytes` adapted to parbench's reference model.

    Assumptions, stated because the exact saved-tensor set depends on PyTorch's kernels:
    no dropout (the model has none), ``bytes_per_element`` = 4 for fp32 runs (2 for bf16),
    attention through ``scaled_dot_product_attention`` with a fused kernel that saves its
    output and log-sum-exp ("flash"); the reshape of the attention output before the
    projection is a copy, so projection input and kernel output are two tensors. The norms'
    own saved tensors besides their input (:func:`norm_saved_bytes`: LayerNorm's mean and
    1/sigma, 2 x 2 s b fp32 values; RMSNorm's 1/rms and normalised input) are added. Not
    counted: allocator rounding, autograd bookkeeping, and the logits/loss of the last stage.

    ``proj_input_copy=False``: the projection's input is a *view* of the kernel's output, one
    storage, so sbh/t e bytes fewer without selective recomputation. That is the case when
    the heads are merged by a transpose and reshape of the kernel's output (the reference
    model, Megatron 1D / SP): torch's CPU flash kernel writes its output sequence-major, in
    the layout of its query, so the reshape copies nothing (measured on torch 2.13). With
    selective recomputation the kernel's output is not kept and the projection input is the
    one saved tensor either way. ``True`` (the default) counts two tensors, as when the
    output is moved by a collective before the projection (Ulysses' all-to-all).
    LLaMA blocks: ``norm`` ... ``attn_mask``, the module doc.
    """
    e = bytes_per_element
    base = layer_activation_bytes(s, b, h, a, t, sp, recompute, ffn_hidden,
                                  bytes_per_element=e, mask_bytes=0,
                                  dropout=False, attention="flash", kv_hidden=kv_hidden,
                                  mlp=mlp, widths=widths, latent=latent,
                                  modules=modules)
    if recompute == "full":
        return base
    # the norms' own tensors; not kept when selective recomputation recomputes the norms
    norms_kept = recompute != "selective" or "layernorm" not in modules
    norms = 2 * (norm_saved_bytes(s * b, h, norm, e) - s * b * h * e) * norms_kept
    if recompute == "none" and not proj_input_copy:
        base -= s * b * (widths[3] if widths else h) * e / t
    llama = _llama_terms(s * b, h, h if kv_hidden is None else kv_hidden,
                         4 * h if ffn_hidden is None else ffn_hidden, mlp, recompute, modules,
                         rope=rope, kv_repeat=kv_repeat, kernel_copies=kernel_copies,
                         rope_recomputed=rope_recomputed)
    tables = rope_table_bytes(s if rope_rows is None else rope_rows, h // a) \
        if llama["rope_kept"] else 0
    mask = packed_mask_bytes(b, s) if attn_mask and llama["core_kept"] else 0
    return base + norms / (t if sp else 1) + llama["elements"] * e / t + tables + mask


def _llama_terms(tokens: int, h: int, kv: int, f: int, mlp: str, recompute: str,
                 modules: frozenset[str], **blocks) -> dict:
    """The elements (before the tensor-parallel split) the reference model keeps beyond
    :func:`layer_activation_bytes`' Q, K, V (h + 2 kv per token) and MLP (Korthikanti's 2f,
    3f for SwiGLU), and whether RoPE's tables are kept (``blocks``: the LLaMA keywords of
    :func:`reference_layer_activation_bytes`)."""
    core_recomputed = recompute == "selective" and "core_attn" in modules
    rope_kept = blocks["rope"] and not (core_recomputed and blocks["rope_recomputed"])
    if core_recomputed:  # the recomputation's inputs: views of the QKV output, or rotated
        qkv = qkv_saved_elements(tokens, h, kv, rope=rope_kept)
    else:
        qkv = qkv_saved_elements(tokens, h, kv, rope=blocks["rope"], repeat=blocks["kv_repeat"],
                                 copies=blocks["kernel_copies"])
    extra = qkv - tokens * (h + 2 * kv)
    if not (recompute == "selective" and "mlp" in modules):
        extra += tokens * (mlp_saved_elements(f, mlp) - (3 if mlp == "swiglu" else 2) * f)
    return {"elements": extra, "rope_kept": rope_kept, "core_kept": not core_recomputed}


def logits_bytes(s: int, b: int, vocab: int, t: int = 1, bytes_per_element: int = 4) -> float:
    """The logits the last pipeline stage keeps for the cross-entropy backward, per
    tensor-parallel rank: s b V / t elements (vocab-parallel head, V the padded vocabulary),
    fp32 by default -- Korthikanti et al. 2022, Sec. 4.3 (total memory: the output layer's
    input and the fp32 logits of the cross-entropy, 4sbh/t (1 + v/h) bytes) and Megatron-LM's
    ``compute_activation_memory`` (``megatron/training/theoretical_memory_usage.py``,
    "Inputs to output layer and CE loss": s b h 4 (1 + V/h) / t, of which 4 s b V / t are
    the logits); ``bytes_per_element=2`` for a bf16 loss (Megatron
    ``--fp16-lm-cross-entropy``). Per micro-batch: under 1F1B the last stage runs each
    micro-batch's backward right after its forward (Narayanan et al. 2021, Sec. 2.2), so it
    holds one micro-batch's logits at a time."""
    for name, v in (("s", s), ("b", b), ("vocab_size", vocab), ("t", t),
                    ("bytes_per_element", bytes_per_element)):
        require_positive_int(name, v)
    return bytes_per_element * s * b * vocab / t


def first_stage_activation_bytes(per_layer_bytes: float, num_layers: int, pp: int,
                                 num_microbatches: int | None = None, vpp: int = 1,
                                 schedule: str = "1f1b") -> float:
    """Activations held at peak by the first pipeline stage (Korthikanti et al. 2022, Sec. 4.2.3).

    With 1F1B the first stage keeps ``p`` micro-batches in flight, each through its ``L/p``
    layers, so it holds ``L`` layers' worth: total = per-layer bytes x L (fewer if there are
    fewer than ``p`` micro-batches). The interleaved schedule multiplies this by
    (1 + (p - 1)/(p v)) for ``v`` chunks per rank. GPipe keeps all ``m`` micro-batches:
    per-layer bytes x (L/p) x m. Embedding and loss activations are not included.
    """
    require_positive_int("num_layers", num_layers)
    require_positive_int("pp", pp)
    require_positive_int("vpp", vpp)
    if num_layers % pp:
        raise ValueError(f"pp={pp} does not divide num_layers={num_layers}")
    layers_here = num_layers // pp
    if schedule == "gpipe":
        if num_microbatches is None:
            raise ValueError("microbatches is required for schedule='gpipe'")
        return per_layer_bytes * layers_here * num_microbatches
    if schedule not in ("1f1b", "interleaved"):
        raise ValueError(f"schedule={schedule!r} must be 1f1b, interleaved or gpipe")
    in_flight = pp if num_microbatches is None else min(pp, num_microbatches)
    factor = 1 + (pp - 1) / (pp * vpp) if vpp > 1 else 1
    return per_layer_bytes * layers_here * in_flight * factor
