"""How :func:`.estimate.estimate` counts, apart from the layout and the options.

A :class:`Counting` holds the choices that change a figure without changing how the ranks are
laid out: the bytes of one activation or gradient element, which model-state accounting
(:mod:`.memory`), eager or flash attention (:mod:`.activations`), the causal FLOP halving
(:mod:`.flops`), the bytes of a logit, and the KV cache of generation. Each field's rule is
checked where the record is built, with a message naming the field, the value and the rule.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..layout import ConfigError
from . import activations, flops, memory

#: dtype name -> bytes per element (``dtype=`` of ``parbench estimate``)
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
#: bytes of one logit: fp32 (Megatron's default) or a bf16 / fp16 loss
LOGITS_BYTES = (4, 2)


@dataclass(frozen=True)
class Counting:
    """How to count (defaults: the behaviour before each option existed).

    - ``bytes_per_element``: activations, gradients and messages (2: bf16 / fp16, 4: fp32);
    - ``accounting``: bytes per parameter of the model states, a :data:`.memory.ACCOUNTINGS`
      name or alias (``None``: ``fp32_adamw`` for 4-byte elements, else ``mixed_adam``);
    - ``attention``: ``"eager"`` (Korthikanti et al. 2022's count with the s x s scores) or
      ``"flash"`` (no s x s tensor kept);
    - ``causal_flops``: ``"full"`` (the s^2 scores counted whole, Narayanan et al. 2021) or
      ``"half"`` (a causal mask halves them);
    - ``logits_bytes``: 4 (fp32 logits) or 2: the last stage's logits of one micro-batch;
    - ``generate``: the KV cache of ``micro_batch_size`` sequences of ``seq_length`` prompt
      and ``generate`` generated tokens (``None``: no KV cache).
    """

    bytes_per_element: int = 2
    accounting: str | None = None
    attention: str = "eager"
    causal_flops: str = "full"
    logits_bytes: int = 4
    generate: int | None = None

    def __post_init__(self) -> None:
        _int_at_least("bytes_per_element", self.bytes_per_element, 1)
        if self.accounting is not None:
            try:
                memory.get_accounting(self.accounting)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        _one_of("attention", self.attention, activations.ATTENTION)
        _one_of("causal_flops", self.causal_flops, flops.CAUSAL)
        if self.logits_bytes not in LOGITS_BYTES:
            raise ConfigError(f"logits_bytes={self.logits_bytes!r} must be 4 (fp32) or "
                              "2 (bf16)")
        if self.generate is not None:
            _int_at_least("generate", self.generate, 0)

    @classmethod
    def of_dtype(cls, dtype: str, **fields: Any) -> "Counting":
        """A counting whose elements are ``dtype`` (fp32, bf16 or fp16)."""
        if dtype not in DTYPE_BYTES:
            raise ConfigError(f"dtype={dtype!r} must be fp32, bf16 or fp16")
        return cls(bytes_per_element=DTYPE_BYTES[dtype], **fields)

    @property
    def accounting_name(self) -> str:
        """The accounting's own name (an alias resolved; ``None`` chosen by the bytes)."""
        chosen = self.accounting or ("fp32_adamw" if self.bytes_per_element == 4
                                     else "mixed_adam")
        return memory.get_accounting(chosen).name

    @property
    def dtype(self) -> str:
        """The time model's precision: fp32 for 4-byte elements, else bf16."""
        return "fp32" if self.bytes_per_element == 4 else "bf16"


def _one_of(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{name}={value!r} must be one of {', '.join(allowed)}")


def _int_at_least(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        what = "a positive integer" if low == 1 else "a non-negative integer"
        raise ConfigError(f"{name}={value!r} must be {what}")
