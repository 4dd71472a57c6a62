"""Packed sequences (``pack_docs``; issue 20, sec. 3): several documents per sample, ended by
an EOD token; attention never crosses a document and positions restart after each EOD
(Megatron-LM's --reset-attention-mask --reset-position-ids). The golden run and the schemes
that support it train the packed model; the others refuse the field before spawning."""
from __future__ import annotations

import pytest
import torch

from parbench.config import CaseConfig, ConfigError, validate_case
from parbench.golden.run import global_batch, reference_model
from parbench.model import build_stage, documents, eod_token
from parbench.overrides import apply_overrides
from parbench.registry import get_scheme
from tests.helpers import run_on_pool

BASE = {"model": "tiny", "dp": "2", "num_microbatches": "2", "steps": "3", "timed_steps": "1",
        "bucket_mb": "0.002", "pack_docs": "3"}


def case_for(scheme: str, **extra) -> CaseConfig:
    case = apply_overrides(CaseConfig(), {**BASE, "scheme": scheme, **extra})
    get_scheme(scheme).check(case)
    return case


def test_documents_end_at_each_eod_and_positions_restart():
    eod = 9
    tokens = torch.tensor([[1, 2, eod, 3, eod, 4, 5, 6]])
    d = documents(tokens, eod)
    assert d.ids.tolist() == [[0, 0, 0, 1, 1, 2, 2, 2]]
    assert d.pos.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]


def test_packed_batches_hold_uneven_documents():
    case = case_for("data.ddp")
    eod = eod_token(case.model)
    for step in range(3):
        x, y = global_batch(case, step)
        per_sample = (x == eod).sum(dim=1)
        assert per_sample.max() <= case.model.pack_docs - 1
        assert len(set(per_sample.tolist())) > 1  # samples and micro-batches differ
        assert torch.equal(x[:, 1:], y[:, :-1])  # still one token stream per sample


def test_attention_never_crosses_a_document():
    """Changing the tokens of a sample's first document leaves the model's output on its
    later documents unchanged, and changes it without packing."""
    case = case_for("data.ddp")
    x, _ = global_batch(case, 0)
    eod = eod_token(case.model)
    row = int((x == eod).sum(dim=1).argmax())
    first_end = int((x[row] == eod).nonzero()[0])
    changed = x.clone()
    changed[row, :first_end] = (changed[row, :first_end] + 1) % eod
    model = reference_model(case)
    later = slice(first_end + 1, None)
    with torch.no_grad():
        a, b = _hidden(model, x)[row, later], _hidden(model, changed)[row, later]
        assert torch.equal(a, b)
        unpacked = reference_model(apply_overrides(case, {"pack_docs": "0"}))
        assert not torch.equal(_hidden(unpacked, x)[row, later],
                               _hidden(unpacked, changed)[row, later])


def test_a_later_stage_without_documents_is_an_error():
    case = case_for("data.ddp", model="tiny-4l")
    stage = build_stage(case.model, 0, 1, 2)
    with pytest.raises(ValueError, match="pack_docs=3"):
        stage(torch.zeros(1, case.model.seq_length, case.model.hidden_size))


@pytest.mark.parametrize("scheme", ["data.ddp", "zero.1", "zero.3", "baseline.torch.fsdp2"])
def test_the_data_family_trains_the_packed_model(pools, scheme):
    merged, _ = run_on_pool(pools, case_for(scheme))
    assert merged.equivalent, merged.first_failure


PIPE = {"model": "tiny-4l", "dp": "1", "pp": "2", "num_microbatches": "4",
        "micro_batch_size": "1"}


@pytest.mark.parametrize("scheme,extra", [
    ("pipeline.zb-h1", {}), ("pipeline.interleaved", {"vpp": "2"}), ("pipeline.chimera", {}),
    ("pipeline.bpipe", {}), ("pipeline.1f1b", {"micro_batch_size": "2", "num_microbatches": "2"})])
def test_every_pipeline_stage_attends_within_documents(pools, scheme, extra):
    """Later stages receive hidden states only: the executor gives them the micro-batch's
    documents, found in its tokens (a stage without them refuses to run, above)."""
    merged, _ = run_on_pool(pools, case_for(scheme, **{**PIPE, **extra}))
    assert merged.equivalent, merged.first_failure


EXPERT = {"model": "tiny", "dp": "2", "ep": "2", "num_experts": "4", "num_microbatches": "2",
          "micro_batch_size": "2", "moe_capacity_factor": "0", "rope_theta": "10000",
          "num_kv_heads": "2", "norm": "rmsnorm"}


@pytest.mark.parametrize("scheme", ["expert.alltoall", "expert.dropless",
                                    "baseline.deepspeed.moe"])
def test_the_expert_family_trains_packed_llama_attention(pools, scheme):
    """The dense parts are the reference model's: documents found in the tokens, RoPE
    restarted with them, grouped-query attention and RMSNorm; the experts route as before."""
    merged, _ = run_on_pool(pools, case_for(scheme, **EXPERT))
    assert merged.equivalent, merged.first_failure


@pytest.mark.parametrize("scheme", ["baseline.torch.context_parallel",
                                    "pipeline.seq1f1b", "pipeline.pipedream"])
def test_schemes_without_packing_refuse_before_spawning(scheme):
    pp = "2" if scheme.startswith("pipeline") else "1"
    case = apply_overrides(CaseConfig(), {**BASE, **PIPE, "pp": pp, "scheme": scheme})
    with pytest.raises(ConfigError, match="pack_docs=3"):
        get_scheme(scheme).check(case)


def test_pack_docs_must_leave_each_document_a_token():
    with pytest.raises(ConfigError, match="pack_docs=16 must be < seq_length=16"):
        validate_case(apply_overrides(CaseConfig(), {**BASE, "pack_docs": "16"}))


def _hidden(model, x):
    docs = model.documents_of(x, None)
    h = model.embed(x, docs)
    for blk in model.blocks.values():
        h = blk(h, docs)
    return h
