"""The zero-bubble split backward (B now, W later) equals the fused backward bit for bit."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from parbench.config import ModelConfig
from parbench.model import build_stage

from impls.pipeline.split_backward import SplitBackward, fused_grads


def _forward(stage, tokens, targets, x0):
    """(boundary, output); on the first stage the boundary is the embedding output."""
    if stage.first:
        boundary = stage.embed(tokens)
    else:
        boundary = x0.clone().requires_grad_(True)
    h = boundary
    for blk in stage.blocks.values():
        h = blk(h)
    out = stage.head(h, targets) if stage.last else h
    return boundary, out


@given(layers=st.integers(1, 3), num_stages=st.integers(1, 3), which=st.integers(0, 2),
       batch=st.integers(1, 2), seed=st.integers(0, 3))
def test_split_backward_equals_fused_bitwise(layers, num_stages, which, batch, seed):
    stage_idx = min(which, num_stages - 1)
    cfg = ModelConfig(num_layers=layers * num_stages, hidden_size=16, num_heads=2,
                      seq_length=8, vocab_size=64)
    stage = build_stage(cfg, seed, stage_idx, num_stages)
    params = list(stage.parameters())
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 64, (batch, 8), generator=g)
    targets = torch.randint(0, 64, (batch, 8), generator=g)
    x0 = torch.randn(batch, 8, 16, generator=g)
    grad_out = None if stage.last else torch.randn(batch, 8, 16, generator=g)

    boundary, out = _forward(stage, tokens, targets, x0)
    dx_ref, w_ref = fused_grads(out, boundary, params, grad_out)

    boundary, out = _forward(stage, tokens, targets, x0)
    split = SplitBackward(out, boundary, params)
    dx = split.input_grad(grad_out)
    w = split.weight_grads()
    assert torch.equal(dx, dx_ref)
    for (name, _), a, b in zip(stage.named_parameters(), w, w_ref):
        assert a is not None, name
        assert torch.equal(a, b), name


def test_shared_weight_across_the_input_path_is_refused():
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    out = lin(lin(x))  # the same weight above and below a node on the input path
    with pytest.raises(NotImplementedError, match="shared weights"):
        SplitBackward(out, x, list(lin.parameters())).input_grad(torch.ones(2, 4))
