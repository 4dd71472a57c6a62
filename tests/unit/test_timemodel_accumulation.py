"""The gradient-accumulation pass (``timemodel.grad_accumulation``): fused adds nothing;
unfused adds, every micro-batch, the buffer read, the gradient read and the buffer written
over every parameter element of the stage (3 e bytes) at the memory bandwidth."""
from __future__ import annotations

import pytest

from parbench.analytic.shape import Shape
from parbench.config import ConfigError
from parbench.timemodel import Training, load_profile, predict_step

V, H, L, S = 1024, 256, 2, 128
SHAPE = Shape(vocab_size=V, hidden_size=H, num_layers=L, num_heads=4, seq_length=S,
              tie_embeddings=True)
# tied token embedding, positions, per layer 12 h^2 weights and 13 h biases and LayerNorm
# parameters, the final LayerNorm
PSI = V * H + S * H + L * (12 * H * H + 13 * H) + 2 * H


@pytest.mark.parametrize("m", [1, 4])
def test_unfused_accumulation_adds_one_pass_per_micro_batch(m):
    prof = load_profile("a100-80gb")
    trn = Training.of(num_microbatches=m, dtype="fp16")
    fused = predict_step(SHAPE, trn, prof).step_s
    unfused = predict_step(SHAPE, trn.with_values(grad_accumulation="unfused"), prof).step_s
    assert unfused - fused == pytest.approx(m * 3 * 2 * PSI / 1.80e12, rel=1e-9)


def test_pipeline_stages_each_accumulate_their_own_parameters():
    """Two stages of one layer each: the first accumulates the embedding and its layer, the
    last its layer, the final LayerNorm and its own copy of the tied word embedding."""
    prof = load_profile("a100-80gb")
    trn = Training.of(pp=2, num_microbatches=4, dtype="fp16", schedule="1f1b")
    stages = [predict_step(SHAPE, t, prof).breakdown["per_microbatch"]["stages"]
              for t in (trn, trn.with_values(grad_accumulation="unfused"))]
    first = V * H + S * H + 12 * H * H + 13 * H
    last = 12 * H * H + 13 * H + 2 * H + V * H
    for i, psi in enumerate((first, last)):
        added = stages[1][i]["tw_s"] - stages[0][i]["tw_s"]
        assert added == pytest.approx(6 * psi / 1.80e12, rel=1e-9)


def test_an_unknown_mode_is_a_config_error():
    with pytest.raises(ConfigError, match="grad_accumulation='sometimes'"):
        predict_step(SHAPE, Training.of(grad_accumulation="sometimes"),
                     load_profile("a100-80gb"))
