"""The model shape the analytic formulas read, units, and input checks.

Every formula in :mod:`parbench.analytic` takes plain numbers or a :class:`Shape`; nothing
here imports the harness configuration. :func:`shape_from` reads any object carrying the
reference model's field names (duck-typed with ``getattr``), so a ``ModelConfig`` or a plain
namespace both work.
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Iterable

#: Binary units, used by the harness reports and by the UB-Mesh table (MB = 2^20, GB = 2^30).
KiB = 2 ** 10
MiB = 2 ** 20
GiB = 2 ** 30
#: Decimal gigabyte, used by the ZeRO paper's memory figures (see ``memory.py``).
GB = 10 ** 9


#: the values of the architecture fields of :class:`Shape`; the first of each is the reference
#: model's (GPT-2 style)
MLP_KINDS = ("gelu", "swiglu")
NORM_KINDS = ("layernorm", "rmsnorm")


@dataclass(frozen=True)
class Shape:
    """Shape of the reference GPT decoder, or of a LLaMA-style one (analytic only).

    ``ffn_hidden_size`` of ``None`` or 0 means ``4 * hidden_size``. ``num_experts`` of 0 is a
    dense model. With ``num_experts = E > 0``, layer ``i`` (0-based) is an MoE layer iff
    ``i % moe_every == 0`` (Megatron-Core's ``moe_layer_freq = k``; ``moe_every = 1``: every
    layer); its MLP is replaced by a router ``h -> E`` without bias and ``E`` expert MLPs of
    the dense MLP's shape, of which ``moe_top_k`` are active per token (Fedus et al. 2021,
    Switch Transformer; Lepikhin et al. 2020, GShard, which puts an MoE layer in every other
    layer, ``moe_every = 2``). ``moe_capacity_factor`` (0 = no limit) bounds the tokens
    each expert takes from one routing group of T tokens to
    ``ceil(moe_capacity_factor * moe_top_k * T / E)`` (:func:`expert_capacity`).

    ``seq_length`` is the whole sequence of one sample; context parallelism splits it, each of
    the ``cp`` ranks holding ``seq_length / cp`` tokens (so UB-Mesh's 8192 tokens per rank at
    cp = 16 is ``seq_length = 131072``).

    Architecture fields (defaults: the reference model, GPT-2 style, Radford et al. 2019):

    - ``num_kv_heads``: grouped-query attention (Ainslie et al. 2023, GQA), K and V have
      ``num_kv_heads`` heads of ``hidden_size / num_heads`` each; 0 means ``num_heads``
      (multi-head attention), 1 is multi-query attention (Shazeer 2019);
    - ``mlp``: ``"gelu"`` (two matrices h -> f -> h) or ``"swiglu"`` (Shazeer 2020, "GLU
      Variants Improve Transformer", Eq. 6; LLaMA, Touvron et al. 2023, Sec. 2.2: three
      matrices, gate and up h -> f, down f -> h);
    - ``norm``: ``"layernorm"`` (weight and bias, 2h) or ``"rmsnorm"`` (Zhang & Sennrich 2019:
      weight only, h);
    - ``bias``: biases on the linear layers (LLaMA has none: Touvron et al. 2023);
    - fine-grained and shared experts (DeepSeekMoE, Dai et al. 2024, Sec. 3.1-3.2; Megatron's
      ``--moe-ffn-hidden-size``, ``--moe-shared-expert-intermediate-size``):
      ``moe_ffn_hidden_size`` is each routed expert's hidden size (0: ``ffn_hidden_size``,
      which the dense layers keep), ``moe_shared_expert_size`` the shared experts' total
      hidden size, one MLP every token of an MoE layer passes (0: none; split over tp and
      replicated over dp like the dense MLP, as Megatron-Core's ``SharedExpertMLP``);
      ``moe_first_dense``: the first layers stay dense (DeepSeek's
      ``first_k_dense_replace``); ``moe_bias_update_rate`` > 0: each MoE layer's router
      keeps E float32 balancing biases, updated after each step from the global load
      (DeepSeek-V3, arXiv 2412.19437, Sec. 2.1.2) -- state, not parameters;
      ``moe_router`` (softmax | sigmoid), group-limited routing (``moe_router_groups``,
      ``moe_router_topk_groups``) and the gates' ``moe_router_scaling`` change no count
      (the router's E x h weight and its per-token top-k either way): carried so that
      ``estimate`` states them;
    - multi-head latent attention (DeepSeek-V2, DeepSeek-AI 2024, Sec. 2.1.2; Megatron's
      ``--multi-latent-attention``), on when ``kv_lora_rank`` > 0: K and V up-projected from
      a ``kv_lora_rank`` latent of each token (normalised), the queries from a ``q_lora_rank``
      latent (0: projected from h directly), every head's query and key ``qk_head_dim`` wide
      plus a ``qk_rope_head_dim`` rotary part (the key's shared by the heads), values
      ``v_head_dim`` wide (0: head_dim); the KV cache holds the latent and the rotary key;
    - ``make_vocab_size_divisible_by``: the vocabulary is padded to a multiple of this times
      tp (Megatron-LM ``--make-vocab-size-divisible-by``, default 128 there;
      ``_vocab_size_with_padding``); 1 pads to a multiple of tp, as the reference model's
      tensor-parallel schemes do. Applied by :func:`parbench.analytic.estimate`, which knows
      tp (:meth:`padded_vocab`); the other functions read ``vocab_size`` as given.
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    seq_length: int
    ffn_hidden_size: int | None = None
    tie_embeddings: bool = False
    position_embeddings: bool = True
    num_experts: int = 0
    moe_top_k: int = 1
    moe_every: int = 1
    moe_capacity_factor: float = 1.0
    num_kv_heads: int = 0
    mlp: str = "gelu"
    norm: str = "layernorm"
    bias: bool = True
    make_vocab_size_divisible_by: int = 1
    moe_ffn_hidden_size: int = 0
    moe_shared_expert_size: int = 0
    moe_first_dense: int = 0
    moe_bias_update_rate: float = 0.0
    moe_router: str = "softmax"
    moe_router_groups: int = 0
    moe_router_topk_groups: int = 0
    moe_router_scaling: float = 1.0
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    mtp_layers: int = 0

    def __post_init__(self) -> None:
        if not self.ffn_hidden_size:
            object.__setattr__(self, "ffn_hidden_size", 4 * self.hidden_size)
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "seq_length",
                     "ffn_hidden_size"):
            require_positive_int(name, getattr(self, name))
        require_nonneg_int("num_experts", self.num_experts)
        if self.num_experts:
            require_positive_int("moe_top_k", self.moe_top_k)
            if self.moe_top_k > self.num_experts:
                raise ValueError(f"moe_top_k={self.moe_top_k} must be <= "
                                 f"num_experts={self.num_experts}")
        require_positive_int("moe_every", self.moe_every)
        require_nonneg("moe_capacity_factor", self.moe_capacity_factor)
        require_nonneg("moe_bias_update_rate", self.moe_bias_update_rate)
        divides("num_heads", self.num_heads, "hidden_size", self.hidden_size)
        require_nonneg_int("num_kv_heads", self.num_kv_heads)
        if self.num_kv_heads:
            divides("num_kv_heads", self.num_kv_heads, "num_heads", self.num_heads)
        if self.mlp not in MLP_KINDS:
            raise ValueError(f"mlp={self.mlp!r} must be one of {', '.join(MLP_KINDS)}")
        if self.norm not in NORM_KINDS:
            raise ValueError(f"norm={self.norm!r} must be one of {', '.join(NORM_KINDS)}")
        if not isinstance(self.bias, bool):
            raise ValueError(f"bias={self.bias!r} must be true or false")
        require_positive_int("make_vocab_size_divisible_by", self.make_vocab_size_divisible_by)
        for name in ("moe_ffn_hidden_size", "moe_shared_expert_size", "moe_first_dense",
                     "kv_lora_rank", "q_lora_rank", "qk_head_dim", "qk_rope_head_dim",
                     "v_head_dim", "mtp_layers"):
            require_nonneg_int(name, getattr(self, name))
        if self.kv_lora_rank and self.bias:
            raise ValueError("kv_lora_rank (multi-head latent attention) is modelled without "
                             "biases: set bias=false")
        if not self.kv_lora_rank and (self.q_lora_rank or self.qk_rope_head_dim):
            raise ValueError("q_lora_rank and qk_rope_head_dim are multi-head latent "
                             "attention's: they need kv_lora_rank > 0")

    # short names used in the formulas of the papers
    @property
    def h(self) -> int:
        return self.hidden_size

    @property
    def f(self) -> int:
        return int(self.ffn_hidden_size)

    @property
    def mla(self) -> bool:
        """Multi-head latent attention (``kv_lora_rank`` > 0)."""
        return self.kv_lora_rank > 0

    def attention_widths(self) -> tuple[int, int, int, int]:
        """(Q, K, V, output) widths over all heads: h, h_kv, h_kv, h; under MLA
        a (d_qk + d_rope), a (d_qk + d_rope), a d_v, a d_v."""
        if not self.mla:
            return self.h, self.kv_hidden, self.kv_hidden, self.h
        qk = self.a * ((self.qk_head_dim or self.head_dim) + self.qk_rope_head_dim)
        v = self.a * (self.v_head_dim or self.head_dim)
        return qk, qk, v, v

    @property
    def mla_latent(self) -> int:
        """Elements per token MLA keeps whole on every tensor-parallel rank: each latent as
        its RMSNorm's input and its up projection's input (2 d_c' + 2 d_c), and the rotary
        key d_R before its rotation; 0 without MLA."""
        if not self.mla:
            return 0
        return 2 * self.q_lora_rank + 2 * self.kv_lora_rank + self.qk_rope_head_dim

    def attention_keywords(self) -> dict:
        """The attention keywords of ``activations.layer_activation_bytes`` for this shape."""
        out = {"kv_hidden": self.kv_hidden, "mlp": self.mlp}
        if self.mla:
            out.update(widths=self.attention_widths(), latent=self.mla_latent)
        return out

    @property
    def expert_f(self) -> int:
        """A routed expert's hidden size: ``moe_ffn_hidden_size``, or the dense f."""
        return self.moe_ffn_hidden_size or self.f

    @property
    def V(self) -> int:  # noqa: N802 - the papers' symbol
        return self.vocab_size

    @property
    def l(self) -> int:  # noqa: E743 - the papers' symbol
        return self.num_layers

    @property
    def s(self) -> int:
        return self.seq_length

    @property
    def a(self) -> int:
        return self.num_heads

    @property
    def moe(self) -> bool:
        return self.num_experts > 0

    @property
    def kv_heads(self) -> int:
        """Key/value heads: ``num_kv_heads``, or ``num_heads`` when it is 0."""
        return self.num_kv_heads or self.num_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def kv_hidden(self) -> int:
        """Width of K (and of V): kv_heads x head_dim (= h without GQA)."""
        return self.kv_heads * self.head_dim

    @property
    def gated(self) -> bool:
        """SwiGLU: the MLP has three matrices (two of them h -> f)."""
        return self.mlp == "swiglu"

    @property
    def norm_params(self) -> int:
        """Parameters of one normalisation layer: 2h (LayerNorm) or h (RMSNorm)."""
        return (2 if self.norm == "layernorm" else 1) * self.hidden_size

    @property
    def gpt_style(self) -> bool:
        """The reference model's architecture: MHA, GeLU MLP, LayerNorm, biases."""
        return (self.kv_heads == self.num_heads and self.mlp == "gelu"
                and self.norm == "layernorm" and self.bias)

    def padded_vocab(self, tp: int = 1) -> int:
        """V' = the smallest multiple of ``make_vocab_size_divisible_by * tp`` not below V
        (Megatron-LM ``_vocab_size_with_padding``); V itself when V is already a multiple."""
        require_positive_int("tp", tp)
        mult = self.make_vocab_size_divisible_by * tp
        return -(-self.vocab_size // mult) * mult

    def is_moe_layer(self, i: int) -> bool:
        """Layer ``i`` (0-based) is an MoE layer: ``num_experts > 0``, and ``i - k`` is a
        non-negative multiple of ``moe_every`` with k = ``moe_first_dense`` (Megatron-Core's
        ``moe_layer_freq``: every ``moe_every``-th layer, after the first k dense ones)."""
        k = self.moe_first_dense
        return self.moe and i >= k and (i - k) % self.moe_every == 0

    @property
    def num_moe_layers(self) -> int:
        """MoE layers of the whole model: ceil(num_layers / moe_every), 0 when dense."""
        return moe_layer_count(self, range(self.num_layers))


def moe_layer_count(shape: Shape, layers: Iterable[int]) -> int:
    """How many of the (0-based, global) layer indices ``layers`` are MoE layers -- e.g. the
    layers one pipeline rank holds (``params.stage_layer_indices``)."""
    return sum(1 for i in layers if shape.is_moe_layer(i))


def expert_capacity(tokens: int, num_experts: int, top_k: int = 1,
                    capacity_factor: float = 1.0) -> int | None:
    """Tokens one expert takes from a routing group of ``tokens`` tokens:
    C = ceil(capacity_factor * top_k * tokens / E): Fedus et al. 2021 (Switch Transformer,
    Sec. 2.2: expert capacity = tokens per batch / experts x capacity factor) with the k
    routed copies of each token counted as in GShard (Lepikhin et al. 2020) and in
    Megatron-Core's ``get_capacity`` (ceil(k T / E x factor)). ``None`` when
    ``capacity_factor`` is 0 (no limit: no token is dropped, no slot is padded). The factor is
    taken as the decimal it prints as (1.1 is 11/10, so 1.1 x 10 tokens give 11, not the 12
    of binary floating point)."""
    require_nonneg_int("tokens", tokens)
    require_positive_int("num_experts", num_experts)
    require_positive_int("moe_top_k", top_k)
    require_nonneg("moe_capacity_factor", capacity_factor)
    if not capacity_factor:
        return None
    return int(-(-exact_factor(capacity_factor) * top_k * tokens // num_experts))


def exact_factor(x: float) -> Fraction:
    """``x`` as the rational number its shortest decimal form names (1.1 -> 11/10)."""
    return Fraction(str(x)) if isinstance(x, float) else Fraction(x)


_SHAPE_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "seq_length",
                 "ffn_hidden_size", "tie_embeddings", "position_embeddings", "num_experts",
                 "moe_top_k", "moe_every", "moe_capacity_factor", "num_kv_heads", "mlp",
                 "norm", "bias", "make_vocab_size_divisible_by", "moe_ffn_hidden_size",
                 "moe_shared_expert_size", "moe_first_dense", "moe_bias_update_rate",
                 "moe_router", "moe_router_groups", "moe_router_topk_groups",
                 "moe_router_scaling", "kv_lora_rank", "q_lora_rank", "qk_head_dim",
                 "qk_rope_head_dim", "v_head_dim", "mtp_layers")


def shape_from(model_cfg: Any, **overrides: Any) -> Shape:
    """A :class:`Shape` from any object with the reference model's field names.

    Missing optional fields take :class:`Shape`'s defaults (so a config without
    ``moe_every`` or ``moe_capacity_factor`` reads as 1 and 1.0); ``overrides`` win over both.
    """
    if isinstance(model_cfg, Shape) and not overrides:
        return model_cfg
    kw: dict[str, Any] = {}
    for name in _SHAPE_FIELDS:
        if hasattr(model_cfg, name):
            kw[name] = getattr(model_cfg, name)
    kw.update(overrides)
    missing = [n for n in _SHAPE_FIELDS[:5] if n not in kw]
    if missing:
        raise ValueError(f"model config lacks required field(s) {', '.join(missing)}")
    return Shape(**kw)


# ---------------------------------------------------------------------------------------
# input checks: each error names the field, the value and the rule it breaks
# ---------------------------------------------------------------------------------------

def require_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")


def require_nonneg_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name}={value!r} must be a non-negative integer")


def require_nonneg(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 \
            or value == float("inf"):
        raise ValueError(f"{name}={value!r} must be a finite number >= 0")


def require_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name}={value!r} must be a positive number")


def divides(div_name: str, div: int, name: str, value: int) -> None:
    """Raise unless ``div`` divides ``value``: "tp=3 does not divide num_heads=8"."""
    require_positive_int(div_name, div)
    if value % div:
        raise ValueError(f"{div_name}={div} does not divide {name}={value}")
