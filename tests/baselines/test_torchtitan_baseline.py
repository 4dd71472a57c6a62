"""torchtitan (``baseline.torchtitan``): its own Llama 3 model with the reference model's
weights computes the reference's loss and gradients (one process: the RoPE row permutation
and the name mapping), and its ``parallelize_llama`` (TP + SP, FSDP2) trains the llama-tiny
case equal to the golden run. Skipped with the reason where torchtitan (and the triton it
imports) is not installed: it is the optional extra ``torchtitan``, not in ``test``.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from parbench.config import CaseConfig, ConfigError
from parbench.model import build_model
from parbench.overrides import apply_overrides
from parbench.registry import get_scheme
from tests.helpers import assert_close_by_the_verdict, run_on_pool

SCHEME = "baseline.torchtitan"
BASE = {"scheme": SCHEME, "model": "llama-tiny", "vocab_size": "61", "num_microbatches": "2",
        "steps": "2", "timed_steps": "0", "param_atol": "1e-4"}


def _skip_without_torchtitan():
    missing = get_scheme(SCHEME).unavailable()
    if missing:
        pytest.skip(missing)


def test_titan_model_computes_the_reference_function():
    _skip_without_torchtitan()
    from impls.baselines.torchtitan_model import from_titan, titan_config, to_titan
    cfg = apply_overrides(CaseConfig(), BASE).model
    ref = build_model(cfg, seed=3)
    titan = titan_config(cfg).build()
    weights = to_titan(cfg, {n: p.detach() for n, p in ref.named_parameters()})
    with torch.no_grad():
        for n, p in titan.named_parameters():
            p.copy_(weights[n])
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=g) for _ in "xy")
    ours = ref(x, y)
    ours.backward()
    theirs = F.cross_entropy(titan(x).flatten(0, 1).float(), y.flatten())
    theirs.backward()
    assert_close_by_the_verdict(theirs.detach(), ours.detach(), "loss")
    grads = from_titan(cfg, {n: p.grad for n, p in titan.named_parameters()})
    for n, p in ref.named_parameters():
        assert_close_by_the_verdict(grads[n], p.grad, n)


@pytest.mark.parametrize("field,value", [("mlp", "gelu"), ("bias", "true"),
                                         ("tie_embeddings", "true"), ("num_kv_heads", "1"),
                                         ("dtype", "bf16")])
def test_what_titan_llama_cannot_run_is_refused(field, value):
    from impls.baselines.torchtitan import check_titan_case
    case = apply_overrides(CaseConfig(), {**BASE, "tp": "2", field: value})
    with pytest.raises(ConfigError, match=field):
        check_titan_case(case)


@pytest.mark.parametrize("layout", [{"tp": "2"}, {"dp": "2"}])
def test_torchtitan_equals_golden(pools, layout):
    _skip_without_torchtitan()
    case = apply_overrides(CaseConfig(), {**BASE, **layout})
    get_scheme(SCHEME).check(case)
    theirs, _ = run_on_pool(pools, case)
    assert theirs.equivalent, theirs
