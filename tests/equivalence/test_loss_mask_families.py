"""A loss mask (``loss_mask``; issue 20, sec. 3) in the tensor, context and expert families:
each sample's leading prompt tokens are left out of the loss, whose mean is over the global
batch's counted tokens (Megatron-LM's --calculate-per-token-loss). The tensor schemes take the
vocab-parallel (or batch-block) cross-entropy over the counted tokens, the context schemes sum
each cp shard's counted tokens (a shard may hold none), the expert schemes scale each
micro-batch by its share of the global count; each equals the golden run by the verdict's
tolerances. One representative case per scheme kind, small enough for a loaded CPU."""
from __future__ import annotations

import pytest

from parbench.config import CaseConfig, ConfigError
from parbench.golden.run import global_batch
from parbench.model import counted_tokens
from parbench.overrides import apply_overrides
from parbench.registry import get_scheme
from tests.helpers import run_on_pool

BASE = {"model": "tiny", "num_microbatches": "2", "steps": "3", "timed_steps": "1",
        "loss_mask": "0.6"}

CASES = {
    "tensor.megatron-sp": {"tp": "2", "vocab_size": "61"},
    "tensor.2d": {"tp": "4"},
    "context.ring-attention": {"cp": "2", "cp_balance": "zigzag"},
    "context.ulysses": {"cp": "2", "dp": "2"},
    "expert.alltoall": {"dp": "2", "ep": "2", "num_experts": "4"},
}


def case_for(scheme: str, **extra) -> CaseConfig:
    case = apply_overrides(CaseConfig(), {**BASE, "scheme": scheme, **CASES.get(scheme, {}),
                                          **extra})
    get_scheme(scheme).check(case)
    return case


@pytest.mark.parametrize("scheme", sorted(CASES))
def test_a_masked_loss_equals_the_golden_run(pools, scheme):
    merged, _ = run_on_pool(pools, case_for(scheme))
    assert merged.equivalent, merged.first_failure


def test_a_cp_shard_of_prompt_only_adds_nothing_and_is_no_nan(pools):
    """With 90% prompts over four contiguous shards, cp rank 0 holds no counted token in a
    whole step: its mean would be 0/0; its summed loss is 0 and the run equals the golden."""
    case = case_for("context.ring-attention", cp="4", cp_balance="none", loss_mask="0.9")
    _, y = global_batch(case, 0)
    assert counted_tokens(y[:, :4]) == 0  # the first of four shards of 16 tokens
    merged, _ = run_on_pool(pools, case)
    assert merged.equivalent, merged.first_failure


@pytest.mark.parametrize("scheme", ["tensor.megatron", "tensor.megatron-sp", "tensor.2d",
                                    "tensor.2.5d", "tensor.3d", "context.ring-attention",
                                    "context.ring-self-attention", "context.ulysses",
                                    "context.usp", "context.allgather",
                                    "context.distflashattn", "context.loongtrain",
                                    "expert.alltoall", "expert.dropless",
                                    "expert.fastermoe", "expert.tutel"])
def test_every_native_scheme_of_the_three_families_accepts_the_mask(scheme):
    assert get_scheme(scheme).supports_loss_mask


@pytest.mark.parametrize("scheme", ["baseline.dtensor.tp", "baseline.megatron.tp",
                                    "baseline.torch.context_parallel",
                                    "baseline.deepspeed.ulysses", "baseline.deepspeed.moe",
                                    "baseline.megatron.moe"])
def test_baselines_with_their_own_loss_refuse_before_spawning(scheme):
    cls = get_scheme(scheme)
    extra = {"num_experts": "4", "ep": "2", "dp": "2"} if cls.family == "expert" else {}
    case = apply_overrides(CaseConfig(), {**BASE, "scheme": scheme, **extra})
    with pytest.raises(ConfigError, match="loss_mask=0.6"):
        cls.check(case)
