"""What a native scheme's closed forms predict for one rank's step, and the whole-replica
model-state rule they share.

:class:`RankPrediction` holds the step's transfers (any axes), the rank's model-state bytes by
tracker category and free-form figures; :func:`flat_states` is the model states of a rank that
keeps whole fp32 (or ``elem_bytes``) copies of the tensors it is given -- parameters,
gradients and the optimizer's states -- and nothing else between steps.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .comm import Transfer, summarize


def adamw_bytes(numel: int, tensors: int, optimizer: str) -> int:
    """AdamW: exp_avg and exp_avg_sq in fp32 plus one 4-byte step per tensor; SGD: none."""
    return 0 if optimizer == "sgd" else 8 * numel + 4 * tensors


def flat_states(sizes: list[int], optimizer: str = "adamw", elem_bytes: int = 4
                ) -> dict[str, int]:
    """Model states of a rank holding the parameter tensors of ``sizes`` elements: Psi e
    parameters, Psi e gradients, AdamW's 8 Psi + 4 T (T tensors, one step each; SGD: 0)."""
    psi = sum(sizes)
    return {"params": psi * elem_bytes, "grads": psi * elem_bytes,
            "optimizer": adamw_bytes(psi, len(sizes), optimizer), "other": 0}


@dataclass
class RankPrediction:
    """One rank's step (every rank alike): transfers per axis, model states, figures."""

    transfers: list[Transfer]
    states: dict[str, int]
    figures: dict = field(default_factory=dict)

    @property
    def wire_bytes(self) -> dict[str, float]:
        """Wire bytes per axis that carries at least one call."""
        return {a: float(v["wire_bytes"]) for a, v in summarize(self.transfers).items()
                if v["count"]}

    @property
    def calls(self) -> dict[str, int]:
        """Collective calls per axis, over groups of more than one rank."""
        out: dict[str, int] = {}
        for t in self.transfers:
            if t.group_size > 1 and t.count:
                out[t.axis] = out.get(t.axis, 0) + t.count
        return out
