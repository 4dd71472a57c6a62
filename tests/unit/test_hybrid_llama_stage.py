"""The hybrid stage on the LLaMA blocks, in one process (issue 21): every rank's stage holds
exactly the elements and tensors ``analytic.hybrid.stage_params`` predicts (GQA's query-group
rows, SwiGLU's gate and up rows, RMSNorm weights, no biases; tp below and above num_kv_heads),
and a cp rank rotates its queries and keys at their global positions in the sample (zig-zag
chunks), or at their within-document positions when packed: what the full sequence's
Megatron heads give at those columns."""
from __future__ import annotations

import pytest
import torch

from parbench.analytic.hybrid import HybridStep, stage_params
from parbench.analytic.shape import shape_from
from parbench.config import CaseConfig
from parbench.model import Documents
from parbench.overrides import apply_overrides

from impls.context.layout import positions
from impls.hybrid.model import HybridStage
from impls.tensor.megatron_model import MegatronGPT


def _case(**ov) -> CaseConfig:
    return apply_overrides(CaseConfig(), {"model": "llama-tiny", **{k: str(v) for k, v in
                                                                   ov.items()}})


def _stage(cfg, tp, r, stage, pos):
    return HybridStage(cfg, 0, tp_group=None, tp=tp, tp_rank=r, sp=False, recompute="none",
                       stage=stage, positions=pos)


@pytest.mark.parametrize("model,tp", [("llama-tiny", 2), ("llama-tiny", 4), ("tiny-4l", 2)])
def test_stage_parameters_equal_the_closed_form(model, tp):
    case = _case(model=model, tp=tp)
    cfg, shape = case.model, shape_from(case.model)
    c = HybridStep(layout=case.layout, options=case.options)
    half = cfg.num_layers // 2
    for lo, hi, first, last in ((0, half, True, False), (half, cfg.num_layers, False, True)):
        pred = stage_params(shape, c, lo, hi, first, last)
        for r in range(tp):
            st = _stage(cfg, tp, r, (lo, hi, first, last), torch.arange(cfg.seq_length))
            params = list(st.parameters())
            assert (sum(p.numel() for p in params), len(params)) == \
                (pred.dense, pred.dense_tensors), (model, tp, lo, r)


def _global_heads(cfg, qkv, docs):
    """Rank 0's (tp 1) q, k at every position of the sample: Megatron's own heads."""
    ref = MegatronGPT(cfg, 0, None, 1, 0)
    q, k, _ = ref.local_heads(qkv, docs)
    g = cfg.num_kv_heads
    return q, k[:, ::cfg.num_heads // g]  # the K/V heads before their repetition


@pytest.mark.parametrize("packed", [False, True])
def test_a_cp_rank_rotates_at_its_global_positions(packed):
    cfg = _case(num_layers=1).model
    s, b = cfg.seq_length, 2
    qkv = torch.randn(s, b, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim)
    docs = None
    if packed:
        ids = (torch.arange(s) >= 5).long() + (torch.arange(s) >= 11).long()
        pos = torch.cat([torch.arange(5), torch.arange(6), torch.arange(5)])
        docs = Documents(ids.expand(b, s).clone(), pos.expand(b, s).clone())
    q_ref, k_ref = _global_heads(cfg, qkv, docs)
    for r in range(2):
        cols = positions(s, 2, r, "zigzag")
        st = _stage(cfg, 1, 0, None, cols)
        q, k, _ = st.cp_heads(qkv[cols], docs)
        torch.testing.assert_close(q.transpose(1, 2), q_ref[:, :, cols], rtol=0, atol=0)
        torch.testing.assert_close(k.transpose(1, 2), k_ref[:, :, cols], rtol=0, atol=0)
