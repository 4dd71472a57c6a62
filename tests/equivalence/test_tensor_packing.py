"""Packed sequences (``pack_docs``; issue 20, sec. 3) on the multi-dimensional tensor-parallel
schemes: 2D (SUMMA / Optimus), 2.5D (Tesseract) and 3D. A grid rank holds whole sequences of
its batch block, finds their documents in its tokens, masks the attention of its heads to
them and embeds the positions within each document -- the 3D rank with the documents of the
rows its QKV output holds (layout L2), not those of its residual stream. Every case equals
the golden run of the packed model and moves exactly the bytes and calls of its closed form,
which packing leaves unchanged; a grid whose attention ignores the documents is caught."""
from __future__ import annotations

import pytest

from parbench.golden.run import global_batch
from parbench.model import eod_token
from parbench.overrides import apply_overrides
from parbench.registry import get_scheme
from parbench.runner import case_row, localise
from parbench.selftest import load
from tests.equivalence.test_tensor import make_case
from tests.helpers import assert_wire_and_calls_per_step, run_on_pool

PACKED = {"pack_docs": 3, "m": 2}


def assert_packed_exact(case, merged, per_rank) -> None:
    """Golden-equivalent, every rank's model states, bytes and calls those of the closed
    form; the closed form is the unpacked case's (packing moves nothing more)."""
    assert merged.equivalent, merged.first_failure
    cls = get_scheme(case.run.scheme)
    pred = cls.predict(case)
    for r in per_rank:
        assert all(s == pred.model_state_bytes[r.rank] for s in r.model_states_per_step)
    assert_wire_and_calls_per_step(pred, per_rank)
    unpacked = cls.predict(apply_overrides(case, {"pack_docs": "0"}))
    assert pred.wire_bytes == unpacked.wire_bytes and pred.calls == unpacked.calls


def test_the_case_has_samples_of_several_documents():
    case = make_case("tensor.2d", 4, mbs=4, **PACKED)
    eod = eod_token(case.model)
    for step in range(case.run.steps):
        x, _ = global_batch(case, step)
        assert (x == eod).sum(dim=1).max() >= 1


@pytest.mark.parametrize("scheme,tp,extra", [
    ("tensor.2d", 4, {"layers": 2, "tie_embeddings": True}),
    ("tensor.2.5d", 8, {"tp_depth": 2, "heads": 8}),
    ("tensor.3d", 8, {"heads": 8})])
def test_grid_schemes_train_the_packed_model(pools, scheme, tp, extra):
    """2.5D: batch block k q + i of each micro-batch; 3D: the attention of rows i q + l
    while the residual stream holds i q + j (a mask of the wrong rows fails rank by rank)."""
    case = make_case(scheme, tp, mbs=4, **{**PACKED, **extra})
    merged, per_rank = run_on_pool(pools, case)
    assert_packed_exact(case, merged, per_rank)


def test_a_grid_attending_across_documents_is_caught_and_localised(pools):
    """The 2D mutant whose attention is plain causal (positions still restarted) fails the
    golden comparison, and the rerun with the grid's probes (its batch block and hidden
    block of each reference module) names the attention of the first layer."""
    load()
    case = make_case("mutant.2d-packed-attention-causal-only", 4, mbs=4, **PACKED)
    row = case_row(case, pools(4))
    assert not row.passed
    localise(case, row, pools(4))
    assert str(row.verdict.first_divergence).startswith(
        "forward output of blocks.0.attn (rank 0, step 0)"), row.verdict.first_divergence
