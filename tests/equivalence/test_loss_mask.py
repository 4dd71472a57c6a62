"""A loss mask (``loss_mask``; issue 20, sec. 3): each sample's leading prompt tokens are left
out of the loss, and the loss is the mean over the global batch's counted tokens (Megatron's
--calculate-per-token-loss). The data family's schemes scale each micro-batch's mean loss by
its share of the global count, and equal the golden run; schemes that do not normalise so
refuse the field before spawning."""
from __future__ import annotations

import pytest
import torch

from parbench.config import CaseConfig, ConfigError
from parbench.golden.run import global_batch
from parbench.model import IGNORE_INDEX, counted_tokens
from parbench.overrides import apply_overrides
from parbench.registry import get_scheme
from tests.helpers import run_on_pool

BASE = {"model": "tiny", "dp": "2", "num_microbatches": "2", "steps": "3", "timed_steps": "1",
        "bucket_mb": "0.002", "loss_mask": "0.6"}


def case_for(scheme: str, **extra) -> CaseConfig:
    case = apply_overrides(CaseConfig(), {**BASE, "scheme": scheme, **extra})
    get_scheme(scheme).check(case)
    return case


def test_the_mask_leaves_every_sample_a_token_and_uneven_micro_batches():
    case = case_for("data.ddp")
    for step in range(3):
        _, y = global_batch(case, step)
        assert ((y != IGNORE_INDEX).sum(dim=1) >= 1).all()
        counts = {counted_tokens(part) for part in y.chunk(4)}  # 2 ranks x 2 micro-batches
        assert len(counts) > 1, counts  # the normalisation matters on this case
        assert (y == IGNORE_INDEX).any()


@pytest.mark.parametrize("scheme", ["data.ddp", "zero.1", "zero.2", "zero.3",
                                    "baseline.torch.ddp", "baseline.torch.fsdp2"])
def test_the_data_family_normalises_by_the_global_token_count(pools, scheme):
    merged, _ = run_on_pool(pools, case_for(scheme))
    assert merged.equivalent, merged.first_failure


@pytest.mark.parametrize("scheme", ["baseline.deepspeed.zero2", "data.local_sgd",
                                    "baseline.dtensor.tp"])
def test_schemes_that_do_not_normalise_refuse_before_spawning(scheme):
    case = apply_overrides(CaseConfig(), {**BASE, "dp": "1", "scheme": scheme})
    with pytest.raises(ConfigError, match="loss_mask=0.6"):
        get_scheme(scheme).check(case)


def test_the_golden_loss_is_the_mean_over_counted_tokens():
    from parbench.golden.run import reference_model
    case = case_for("data.ddp")
    x, y = global_batch(case, 0)
    model = reference_model(case)
    with torch.no_grad():
        logits = model.head.out(model.head.ln(_hidden(model, x)))
        per_token = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), y.reshape(-1).clamp(min=0), reduction="none")
        keep = (y.reshape(-1) != IGNORE_INDEX).float()
        want = float((per_token * keep).sum() / keep.sum())
        assert abs(float(model(x, y)) - want) <= 1e-6 * abs(want)


def _hidden(model, x):
    h = model.embed(x)
    for blk in model.blocks.values():
        h = blk(h)
    return h
