"""Tied word embeddings on the native pipeline schemes (issue 20, section 2): the first stage's
embedding and the last stage's output layer are two copies, initialised equal, whose
gradients are summed over the embedding group before the optimizer step (Megatron-LM's
``_allreduce_word_embedding_grads``; Narayanan et al. 2021). Every synchronous schedule
equals the golden run of the tied model, and its bytes, calls and model states equal the
closed forms, the embedding group's all-reduce included (axis ``embd``: V h fp32 bytes and one
call on each rank that holds exactly one copy, nothing where one rank holds both). The two
mutants of the self-test that break the synchronisation are caught, and the asynchronous
schedules refuse tied embeddings before spawning."""
from __future__ import annotations

import pytest

from parbench.config import ConfigError
from parbench.testing import NotEquivalent, assert_bytes, assert_equivalent, make_case

#: the tiny odd shape of the pipeline family's default set, tied
TIED = dict(model="tiny-4l", vocab_size=61, hidden_size=35, num_heads=5, seq_length=11,
            tie_embeddings=True, steps=3, timed_steps=0)

#: (schedule, fields): every placement kind -- linear, looped, V, wave, bidirectional --
#: and the split-backward, evicting and token-slice executors
SCHEDULES = [
    ("1f1b", dict(pp=2, num_microbatches=3)),
    ("gpipe", dict(pp=2, num_microbatches=2)),
    ("zb-h1", dict(pp=2, num_microbatches=4)),
    ("interleaved", dict(pp=2, vpp=2, num_microbatches=4)),
    ("zbv", dict(pp=2, num_microbatches=4)),
    ("hanayo", dict(pp=2, vpp=2, num_microbatches=4)),
    ("chimera", dict(pp=2, num_microbatches=4)),
    ("dualpipev", dict(pp=2, num_microbatches=4)),
    ("bpipe", dict(pp=2, num_microbatches=4)),
    ("seq1f1b", dict(pp=2, num_microbatches=2, seq_segments=2)),
    ("1f1b", dict(pp=4, num_microbatches=4)),  # the embedding group is ranks 0 and 3 only
]


@pytest.mark.parametrize("name, fields", SCHEDULES,
                         ids=[f"{n}-pp{f['pp']}" for n, f in SCHEDULES])
def test_tied_embeddings_equal_the_golden_run_and_the_closed_forms(parbench_pool, name,
                                                                   fields):
    case = make_case(f"pipeline.{name}", **TIED, **fields)
    assert_equivalent(case.run.scheme, case=case, pool=parbench_pool)
    run = assert_bytes(case.run.scheme, case=case, pool=parbench_pool, states=True)
    embd = [w.get("embd", 0.0) for w in run.merged.wire_by_step[0]]
    assert any(embd) == (name in ("1f1b", "gpipe", "zb-h1", "interleaved", "bpipe",
                                  "seq1f1b")), embd
    assert all(b in (0.0, 61 * 35 * 4) for b in embd), embd


@pytest.mark.parametrize("mutant", ["1f1b-tied-unsynced", "1f1b-tied-one-way"])
def test_unsynchronised_tied_gradients_are_caught(parbench_pool, mutant):
    with pytest.raises(NotEquivalent, match="embed.tok.weight"):
        assert_equivalent(f"mutant.{mutant}", pool=parbench_pool, **TIED, pp=2,
                          num_microbatches=4)


def test_asynchronous_schedules_refuse_tied_embeddings():
    for name in ("pipedream", "2bw"):
        with pytest.raises(ConfigError, match="asynchronously"):
            make_case(f"pipeline.{name}", **TIED, pp=2, num_microbatches=2)
