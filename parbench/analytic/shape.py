"""The model shape the analytic formulas read, units, and input checks.

Every formula in :mod:`parbench.analytic` takes plain numbers or a :class:`Shape`; nothing
here imports the harness configuration. :func:`shape_from` reads any object carrying the
reference model's field names (duck-typed with ``getattr``), so a ``ModelConfig`` or a plain
namespace both work.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: Binary units, used by the harness reports and by the UB-Mesh table (MB = 2^20, GB = 2^30).
KiB = 2 ** 10
MiB = 2 ** 20
GiB = 2 ** 30
#: Decimal gigabyte, used by the ZeRO paper's memory figures (see ``memory.py``).
GB = 10 ** 9


@dataclass(frozen=True)
class Shape:
    """Shape of the reference GPT decoder.

    ``ffn_hidden_size`` of ``None`` or 0 means ``4 * hidden_size``. ``num_experts`` of 0 is a
    dense model; with ``num_experts > 0`` every layer is an MoE layer (router ``h -> E``
    without bias plus ``E`` expert MLPs) and ``moe_top_k`` experts are active per token.
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
        divides("num_heads", self.num_heads, "hidden_size", self.hidden_size)

    # short names used in the formulas of the papers
    @property
    def h(self) -> int:
        return self.hidden_size

    @property
    def f(self) -> int:
        return int(self.ffn_hidden_size)

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


_SHAPE_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "seq_length",
                 "ffn_hidden_size", "tie_embeddings", "position_embeddings", "num_experts",
                 "moe_top_k")


def shape_from(model_cfg: Any, **overrides: Any) -> Shape:
    """A :class:`Shape` from any object with the reference model's field names.

    Missing optional fields take :class:`Shape`'s defaults; ``overrides`` win over both.
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


def require_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name}={value!r} must be a positive number")


def divides(div_name: str, div: int, name: str, value: int) -> None:
    """Raise unless ``div`` divides ``value``: "tp=3 does not divide num_heads=8"."""
    require_positive_int(div_name, div)
    if value % div:
        raise ValueError(f"{div_name}={div} does not divide {name}={value}")
