"""The hybrid's training features (issue 20, sec. 3) on real gloo ranks: a masked loss
normalised by the global count of counted tokens (Megatron-LM's --calculate-per-token-loss),
packed documents (attention within documents, positions restarted, on every pipeline stage
and across all-gather CP's shards) and tied embeddings across pipeline stages (the embedding
group's all-reduce of each tp rank's rows). Each case equals the golden run, and every rank's
wire bytes, calls and model states per axis equal ``parbench.analytic.hybrid`` on every step,
the ``embd`` all-reduce and the last stage's copy of the tied weight included. A cp core that
does not declare that it masks documents refuses ``pack_docs`` with cp > 1 before spawning."""
from __future__ import annotations

import pytest

from parbench.config import ConfigError
from parbench.golden.run import global_batch
from parbench.model import counted_tokens
from parbench.registry import get_scheme
from tests.equivalence.test_hybrid import assert_exact, make_case
from tests.helpers import run_on_pool

FEATURES = {"steps": 3, "timed_steps": 1, "tie_embeddings": True, "loss_mask": 0.6,
            "pack_docs": 3}
#: the tp rank's V'/t x h fp32 rows of the tied weight (tiny-4l: h = 32; V' = 62 at tp 2)
EMBD_TP2 = 31 * 32 * 4


def test_interleaved_tp_pp_with_every_feature_zero1_and_clipping(pools):
    """tp 2 x pp 2, interleaved (stages 0 and 2 on rank 0, 1 and 3 on rank 1): the tied
    weight's first and last stage on different ranks, so every rank all-reduces its V'/t rows
    over ``embd``; a later stage attends within the documents the executor hands it; the
    masked loss, ZeRO-1 and clipping (the copy left out of the norm) on the same step."""
    case = make_case(tp=2, pp=2, schedule="interleaved", vpp=2, num_microbatches=2,
                     zero_stage=1, clip_grad=0.5, **FEATURES)
    merged, per_rank = run_on_pool(pools, case)
    assert_exact(case, merged, per_rank)
    assert merged.clipped_steps == case.run.steps
    embd = [w.get("embd") for w in get_scheme("hybrid").predict(case).wire_at(0)]
    assert embd == [EMBD_TP2] * 4, embd


def test_allgather_cp_pp_masks_documents_and_a_prompt_only_shard(pools):
    """cp 2 (all-gather) x pp 2, one sample per micro-batch, 90% prompts: cp rank 0's shard
    of micro-batch 1 holds no counted token at step 0 (its summed loss is 0, not 0/0); the
    packed documents mask the gathered keys on both stages, in 1F1B's interleaved forwards
    and backwards; the tied copies add their gradients over ``embd``."""
    case = make_case(cp=2, pp=2, cp_algorithm="allgather", micro_batch_size=1,
                     num_microbatches=2, **{**FEATURES, "loss_mask": 0.9})
    _, y = global_batch(case, 0)
    assert counted_tokens(y[1:, :y.shape[1] // 2]) == 0
    merged, per_rank = run_on_pool(pools, case)
    assert_exact(case, merged, per_rank)


def test_ring_attention_cp_masks_documents(pools):
    """tp 2 x cp 2 ring attention (zig-zag): the ring core masks each block with the
    micro-batch's documents (``impls.context.documents``), handed per call by the hybrid."""
    from impls.hybrid.model import core_packs
    assert core_packs("ring-attention")
    case = make_case(tp=2, cp=2, cp_algorithm="ring-attention", cp_balance="zigzag",
                     steps=3, timed_steps=1, loss_mask=0.6, pack_docs=3)
    merged, per_rank = run_on_pool(pools, case)
    assert_exact(case, merged, per_rank)


@pytest.mark.parametrize("kind", ["allgather", "ring-attention", "ulysses"])
def test_packing_with_cp_follows_the_core_class_declaration(kind, monkeypatch):
    """With cp > 1 the hybrid packs only with a cp core whose class declares
    ``supports_packing`` (all-gather, ring and Ulysses CP), and refuses the case before spawning otherwise; with cp = 1 the
    Megatron stage's own mask serves every kind."""
    from impls.hybrid import model
    make_case(cp=1, tp=2, cp_algorithm=kind, pack_docs=3)
    core = model.CORE_CLASSES[kind]
    monkeypatch.setattr(core, "supports_packing", False, raising=False)
    with pytest.raises(ConfigError, match=f"pack_docs=3: hybrid's cp_algorithm='{kind}'"):
        make_case(cp=2, cp_algorithm=kind, pack_docs=3)
    monkeypatch.setattr(core, "supports_packing", True, raising=False)
    make_case(cp=2, cp_algorithm=kind, pack_docs=3)


@pytest.mark.parametrize("schedule, embd", [("1f1b", True), ("zbv", False),
                                            ("chimera", False)])
def test_the_embedding_group_all_reduce_in_closed_form(schedule, embd):
    """Linear stages: each rank holds one copy and all-reduces it; the V placement (stages 0
    and 3 on rank 0) and Chimera (stage 0 of one pipe beside stage 1 of the other) add their
    copies locally. Model states count the last stage's copy either way."""
    case = make_case(tp=2, pp=2, schedule=schedule, tie_embeddings=True, num_microbatches=4)
    untied = make_case(tp=2, pp=2, schedule=schedule, num_microbatches=4)
    pred, plain = (get_scheme("hybrid").predict(c) for c in (case, untied))
    assert [w.get("embd", 0) for w in pred.wire_at(0)] == [EMBD_TP2 if embd else 0] * 4
    assert [c.get("embd", 0) for c in pred.calls_at(0)] == [int(embd)] * 4
    assert pred.model_state_bytes == plain.model_state_bytes  # the copy is still a tensor
