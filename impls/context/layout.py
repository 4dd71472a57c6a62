"""Which tokens of the sequence a context-parallel rank holds.

- ``none``: contiguous shards, rank r holds [r n, (r+1) n) with n = s/cp;
- ``zigzag``: 2 cp chunks of s/(2cp), rank r holds chunks r and 2cp-1-r (Megatron-Core's
  load balancing, Llama 3 Sec. 3.3.2, torch's head-tail load balancer);
- ``striped``: rank r holds tokens r, r + cp, r + 2cp, ... (Brandon et al. 2023, Sec. 3.1).

Within a rank the tokens are kept in increasing position, so the causal mask between two
blocks is one of: full, causal (key index <= query index), strictly lower, or none -- see
``ring.block_plan``. USP (Fang & Zhao 2024) lays the ring level out first and cuts each ring
rank's tokens into contiguous pieces over its Ulysses group, so that the Ulysses all-to-all
gathers exactly the ring rank's tokens back in order (``usp_positions``).
"""
from __future__ import annotations

from functools import lru_cache

import torch

BALANCES = ("none", "zigzag", "striped")


@lru_cache(maxsize=256)
def _positions(s: int, cp: int, rank: int, balance: str) -> tuple[int, ...]:
    if balance == "none":
        n = s // cp
        return tuple(range(rank * n, (rank + 1) * n))
    if balance == "zigzag":
        c = s // (2 * cp)
        return tuple(range(rank * c, (rank + 1) * c)) + \
            tuple(range((2 * cp - 1 - rank) * c, (2 * cp - rank) * c))
    if balance == "striped":
        return tuple(range(rank, s, cp))
    raise ValueError(f"cp_balance={balance!r} must be one of {', '.join(BALANCES)}")


def positions(s: int, cp: int, rank: int, balance: str = "none") -> torch.Tensor:
    """Global positions of rank ``rank``'s tokens, increasing (a new LongTensor each call: a
    scheme holds no tensor between steps)."""
    return torch.tensor(_positions(s, cp, rank, balance), dtype=torch.long)


def usp_positions(s: int, ulysses: int, ring: int, ulysses_rank: int, ring_rank: int,
                  balance: str = "none") -> torch.Tensor:
    """USP: the ring rank's tokens (``balance`` over ``ring`` ranks), of which Ulysses rank
    ``ulysses_rank`` holds the ``ulysses_rank``-th contiguous piece of s/(u r)."""
    ring_tokens = _positions(s, ring, ring_rank, balance)
    n = len(ring_tokens) // ulysses
    return torch.tensor(ring_tokens[ulysses_rank * n:(ulysses_rank + 1) * n], dtype=torch.long)
