"""The verdict's reference work done once on rank 0 and sent to every rank
(``shared_reference``, issue 24) decides exactly as each rank computing it: the same figures
on a correct case (replicas hold identical weights, so rank 0's reference is every rank's),
and the same failures on a broken one."""
from __future__ import annotations

import pickle

import pytest
import torch

from parbench.config import CaseConfig
from parbench.mutation import base_case
from parbench.overrides import apply_overrides
from parbench.selftest import load
from parbench.verdict.once import pack, unpack
from tests.helpers import run_on_pool


def _figures(merged):
    return (merged.equivalent, merged.max_loss_abs, merged.max_grad_abs, merged.max_param_abs,
            merged.max_update_excess)


@pytest.mark.parametrize("fields", [
    {"scheme": "data.ddp", "dp": 2, "num_microbatches": 2},
    {"scheme": "zero.3", "dp": 2, "timed_steps": 2, "warmup_steps": 0},
    {"scheme": "hybrid", "tp": 2, "pp": 2, "timed_steps": 2, "warmup_steps": 0}])
def test_once_and_on_every_rank_give_the_same_verdict(pools, fields):
    base = apply_overrides(CaseConfig(), {"model": "tiny", "steps": 3, **fields})
    got = {}
    for shared in (True, False):
        case = apply_overrides(base, {"shared_reference": shared})
        merged, per_rank = run_on_pool(pools, case)
        got[shared] = (_figures(merged), [r.final and r.final.param_max_abs for r in per_rank])
        assert merged.equivalent, (shared, merged)
        assert all(0 <= r.verdict_s <= r.case_s for r in per_rank)
    assert got[True] == got[False]


@pytest.mark.parametrize("mutant_id, check", [("ddp-no-divide", "max_grad_abs"),
                                               ("ddp-skip-after-checked", "final")])
def test_a_broken_scheme_fails_either_way(pools, mutant_id, check):
    """A gradient bug fails the stepwise reference's check, a bug after the checked steps the
    final state's continuation, whichever rank computes the reference."""
    m = load()[mutant_id]
    for shared in (True, False):
        case = apply_overrides(base_case(m, m.scheme, 0), {"shared_reference": shared})
        merged, per_rank = run_on_pool(pools, case)
        assert not merged.equivalent or any(r.final and not r.final.param_ok
                                            for r in per_rank), (mutant_id, shared)
        if check == "final":
            assert all(r.final and not r.final.param_ok for r in per_rank), shared
        else:
            assert merged.max_grad_abs > 0 and not merged.equivalent, shared


def test_pack_keeps_values_dtypes_and_grad_flags():
    obj = {"w": torch.randn(3, 2, requires_grad=True),
           "s": (torch.ones(4, dtype=torch.bfloat16), {"step": torch.tensor(7.0), "k": 5}),
           "i": [torch.arange(5)]}
    back = unpack(pickle.loads(pickle.dumps(pack(obj))))
    assert torch.equal(back["w"], obj["w"].detach()) and back["w"].requires_grad
    assert back["s"][0].dtype == torch.bfloat16 and torch.equal(back["s"][0], obj["s"][0])
    assert back["s"][1]["k"] == 5 and torch.equal(back["s"][1]["step"], obj["s"][1]["step"])
    assert torch.equal(back["i"][0], obj["i"][0]) and back["i"][0].dtype == torch.int64
