"""Each family's default case set (``parbench.testing.defaults``, issue 20 section 2) without
ranks: what it covers, that ``verify``, ``assert_equivalent`` and ``cases`` take it from the
one place, and the closed form of the tied embedding's all-reduce that its pipeline cases
need (``parbench.analytic.pipeline.tied_embedding_traffic``)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parbench.analytic import pipeline as closed
from parbench.analytic.shape import shape_from
from parbench.config import ConfigError, ModelConfig
from parbench.model import build_model
from parbench.registry import get_scheme
from parbench.testing import cases, default_set
from parbench.testing import helpers as testing_helpers
from parbench.testing.defaults import BASES, default_cases, option_values

from impls.data.ddp import NativeDDP
from impls.tensor.megatron import Megatron1D

NATIVES = ["data.ddp", "zero.1", "pipeline.1f1b", "tensor.megatron", "context.ring-attention",
           "expert.alltoall", "hybrid"]


def _numel(case) -> int:
    return sum(p.numel() for p in build_model(case.model, 0).parameters())


@pytest.mark.parametrize("name", NATIVES)
def test_every_default_case_accumulates_steps_and_pads(name):
    got, _ = default_cases(get_scheme(name), name)
    assert got, name
    for c in got:
        assert c.layout.num_microbatches >= 2 and c.run.steps >= 3, c.id
        assert c.layout.world_size <= 4, c.id
        assert c.model.name.startswith("tiny") or c.model.name == "llama-tiny", c.id
        degrees = [d for d in c.layout.degrees().values() if d > 1]
        assert all(c.model.vocab_size % d for d in degrees), c.id  # the vocabulary pads
    assert got[0].run.timed_steps > got[0].run.warmup_steps  # the time ratio's case


def test_data_cases_pad_every_dp_and_include_an_odd_dp_and_tied_embeddings():
    got, _ = default_cases(NativeDDP, "data.ddp")
    dps = {c.layout.dp for c in got}
    assert dps == {2, 3}
    assert any(c.model.tie_embeddings for c in got)
    for c in got:  # the flat buffer of ZeRO pads in every case (untied: at dp 2 and 3)
        if c.model.name == "llama-tiny":
            continue  # RoPE needs an even head_dim, so every tensor is even: no odd buffer
        n = _numel(c)
        assert n % c.layout.dp, (c.id, n)
        assert c.model.tie_embeddings or (n % 2 and n % 3), (c.id, n)


def test_pipeline_cases_tie_embeddings_also_over_pp_x_dp():
    class AnyDP(get_scheme("pipeline.1f1b")):  # a user's pipeline that takes dp too
        name = ""

        @classmethod
        def check(cls, case):
            pass

    got, _ = default_cases(AnyDP, "x:AnyDP")
    tied = [(c.layout.pp, c.layout.dp) for c in got if c.model.tie_embeddings]
    assert (2, 1) in tied and (2, 2) in tied
    native, left_out = default_cases(get_scheme("pipeline.1f1b"), "pipeline.1f1b")
    assert any(c.model.tie_embeddings for c in native)  # native pipelines tie them now
    assert any("dp=2" in why and "one pipeline" in why for why in left_out)


class SPAndRecompute(Megatron1D):
    """A user's tensor scheme that reads sp and recompute (not registered)."""

    name = ""
    options = ("sp", "recompute")
    # no training features or LLaMA blocks declared: no feature cases (tested below)
    supports_clip_grad = supports_loss_mask = supports_packing = False
    model_features = frozenset()

    @classmethod
    def check(cls, case):
        super(Megatron1D, cls).check(case)


def test_each_declared_option_value_is_covered_once_where_it_takes_effect():
    got, left_out = default_cases(SPAndRecompute, "x:SPAndRecompute")
    assert not left_out
    assert {c.options.tensor.sp for c in got} == {False, True}
    assert {c.options.recompute for c in got} == {"none", "selective", "full"}
    assert len(got) == 3  # each value once (max 3 values), not the 6 of the cross product
    assert all(c.layout.tp == 2 for c in got)


def test_option_values_come_from_the_field_metadata():
    assert option_values("sp") == (False, True)
    assert option_values("cp_balance") == ("zigzag", "none", "striped")
    assert option_values("zero_stage") == (0, 1, 2, 3)
    assert option_values("bucket_mb") == (0.25, 0.01)
    assert option_values("tp_depth") == ()  # numeric, not varied


def test_context_balance_values_all_run_on_cp_cases():
    got, _ = default_cases(get_scheme("context.ring-attention"), "context.ring-attention")
    assert {c.options.context.cp_balance for c in got} == {"none", "zigzag", "striped"}
    assert all(c.layout.cp == 2 for c in got)


def test_verify_assert_equivalent_and_cases_share_the_default_set(monkeypatch):
    from parbench.cli.verify import _cases
    ids = [c.id for c in default_cases(NativeDDP, "data.ddp")[0]]
    assert [c.id for c in _cases(NativeDDP, "data.ddp", None, {})[0]] == ids
    assert [c.id for c in default_set(NativeDDP)] == ids
    ran = []
    monkeypatch.setattr(testing_helpers, "run_scheme",
                        lambda scheme, case=None, pool=None, **f: ran.append(case.id) or
                        _Passing())
    testing_helpers.assert_equivalent(NativeDDP)
    assert ran == ids


class _Passing:
    equivalent = True


@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_cases_draw_from_the_default_set(data):
    case = data.draw(cases("tensor", scheme=SPAndRecompute))
    defaults = default_cases(SPAndRecompute, "x:SPAndRecompute")[0]
    assert (case.options.tensor.sp, case.options.recompute, case.layout.num_microbatches) in \
        {(c.options.tensor.sp, c.options.recompute, c.layout.num_microbatches)
         for c in defaults}


class NoneSuits(NativeDDP):
    """A user's scheme that refuses every case."""

    name = ""

    @classmethod
    def check(cls, case):
        raise ConfigError("never")


def test_a_scheme_no_default_case_suits_is_one_error():
    with pytest.raises(ConfigError, match="accepts none of the data family's default cases"):
        default_set(NoneSuits)
    assert sorted(BASES) == ["context", "data", "expert", "hybrid", "pipeline", "tensor"]


# ---- the tied embedding's all-reduce in closed form -------------------------------------------

SHAPE = shape_from(ModelConfig(vocab_size=61, hidden_size=35, num_heads=5, num_layers=8,
                               tie_embeddings=True))
#: V h fp32 bytes: 2 (n-1)/n of the tied weight at n = 2
TIED_BYTES = 61 * 35 * 4


@pytest.mark.parametrize("placement, p, v, holders", [
    ("linear", 2, 1, {0, 1}),
    ("linear", 4, 1, {0, 3}),          # the embedding group is not the pp group
    ("looped", 2, 2, {0, 1}),
    ("wave", 4, 3, {0, 3}),            # odd v: the last stage runs down to rank p-1
    ("wave", 4, 2, set()),             # even v: it comes back to rank 0
    ("v", 4, 1, set()),                # stages 0 and 2p-1 on rank 0
    ("bidirectional", 4, 1, set()),    # rank 0: stage 0 of one pipe, p-1 of the other
])
def test_tied_embedding_allreduce_on_the_ranks_holding_one_copy(placement, p, v, holders):
    for r in range(p):
        want = (TIED_BYTES, 1) if r in holders else (0, 0)
        assert closed.tied_embedding_traffic(SHAPE, placement, p, r, v) == want, r


def test_untied_or_single_stage_sends_nothing():
    untied = shape_from(ModelConfig(vocab_size=61, hidden_size=35, num_heads=5))
    assert closed.tied_embedding_traffic(untied, "linear", 2, 0) == (0, 0)
    assert closed.tied_embedding_traffic(SHAPE, "linear", 1, 0) == (0, 0)


def test_asynchronous_pipelines_refuse_tied_embeddings_before_spawning():
    from parbench.testing import make_case
    with pytest.raises(ConfigError, match="tie_embeddings=true: pipeline.pipedream"):
        make_case("pipeline.pipedream", model="tiny-4l", pp=2, num_microbatches=2,
                  tie_embeddings=True)


def test_the_features_a_scheme_declares_get_a_case():
    """Issue 20 sec. 3 and issue 21: clipping, the masked loss and packed documents on one
    case where the scheme declares them, and the LLaMA-3 blocks where it runs them all."""
    got, _ = default_cases(NativeDDP, "data.ddp")
    feats = [c for c in got if c.run.clip_grad]
    assert len(feats) == 1
    assert (feats[0].run.loss_mask, feats[0].model.pack_docs) == (0.6, 3)
    assert any(c.model.name == "llama-tiny" and c.model.rope_theta for c in got)

    class GPT2Only(NativeDDP):  # a user's DDP that runs the GPT-2 blocks only
        name = ""
        model_features = frozenset()
        supports_packing = False
    got, _ = default_cases(GPT2Only, "x:GPT2Only")
    assert not any(c.model.name == "llama-tiny" or c.model.pack_docs for c in got)


@pytest.mark.parametrize("name, tp", [("tensor.2d", 4), ("tensor.2.5d", 8), ("tensor.3d", 8)])
def test_a_grid_scheme_gets_default_cases_on_its_own_grid(name, tp):
    """The tensor family's default cases run tp = 2, which no q x q (x d) grid is; a grid
    scheme's ``default_fields`` put them on its grid, so ``parbench verify scheme=tensor.2d``
    with no field runs (the structural cases, the features case and the LLaMA blocks)."""
    cls = get_scheme(name)
    built, skipped = default_cases(cls, name)
    assert len(built) >= 3 and not skipped, skipped
    assert {c.layout.tp for c in built} == {tp}
    assert any(c.model.rope_theta > 0 for c in built)  # the LLaMA blocks' case
