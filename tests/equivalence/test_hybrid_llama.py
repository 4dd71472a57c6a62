"""The hybrid on the LLaMA blocks (issue 21): RoPE, grouped-query attention (num_kv_heads 2 of
4 heads), SwiGLU, RMSNorm and no biases on ``llama-tiny``, against the golden run, every
rank's wire bytes, calls and model states per axis equal to ``parbench.analytic.hybrid`` on
every step (the GQA QKV rows and SwiGLU's gate and up rows in the parameter count, K/V at
their g/t heads in the cp traffic). Under cp the rank's tokens are rotated at their global
positions (zig-zag chunks), or at their within-document positions when packed (as the golden
run restarts them)."""
from __future__ import annotations

import pytest

from parbench.config import ConfigError
from tests.equivalence.test_hybrid import assert_exact, make_case
from tests.helpers import run_on_pool

LLAMA = {"model": "llama-tiny", "steps": 2, "timed_steps": 0}


@pytest.mark.parametrize("lay", [
    {"tp": 2, "cp": 2, "cp_algorithm": "ring-attention", "cp_balance": "zigzag"},
    {"tp": 2, "pp": 2, "sp": True, "recompute": "selective"},
    {"cp": 2, "dp": 2, "cp_algorithm": "allgather", "pack_docs": 3},
])
def test_hybrid_runs_the_llama_blocks_byte_exact(pools, lay):
    case = make_case(**LLAMA, **lay)
    merged, per_rank = run_on_pool(pools, case)
    assert_exact(case, merged, per_rank)


def test_ulysses_needs_cp_to_divide_the_ranks_kv_heads():
    """llama-tiny at tp 2: 1 K/V head per rank, which Ulysses cannot split over cp 2."""
    with pytest.raises(ConfigError, match="num_kv_heads/tp=1"):
        make_case(**LLAMA, tp=2, cp=2, cp_algorithm="ulysses")
