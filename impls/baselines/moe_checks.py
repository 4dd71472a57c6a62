"""What the MoE baselines share before spawning: their dropping order differs from the
reference's, so only cases where nothing can be dropped compare."""
from __future__ import annotations

from parbench.analytic.expert import capacity
from parbench.config import CaseConfig, ConfigError


def no_drop_capacity(name: str, case: CaseConfig) -> int:
    """The per-group capacity C, after refusing a case where C < the group's tokens."""
    m, p = case.model, case.layout
    tokens = p.micro_batch_size * m.seq_length
    c = capacity(tokens, m.num_experts, m.moe_top_k, m.moe_capacity_factor)
    if c < tokens:
        raise ConfigError(f"moe_capacity_factor={m.moe_capacity_factor} gives capacity "
                          f"{c} < {tokens} tokens per group: {name} would drop tokens "
                          "in another order (set moe_capacity_factor=0, no limit)")
    return c
