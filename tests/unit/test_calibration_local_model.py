"""What ``parbench calibrate`` times as a layer is the reference model's layer: the same
autograd operators, one for one (a view and a reshape alias count as one kind), on the
dense presets with learned positions and with RoPE, GQA, SwiGLU and RMSNorm."""
import collections

import pytest
import torch

from parbench.analytic.shape import shape_from
from parbench.calibration.local_model import LocalLayer
from parbench.calibration.plan import model_config
from parbench.model.gpt import Block

SAME = {"ReshapeAliasBackward0": "ViewBackward0", "UnsafeViewBackward0": "ViewBackward0"}


def _operators(module, x) -> collections.Counter:
    seen, stack, kinds = set(), [module(x).grad_fn], collections.Counter()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        name = type(node).__name__
        kinds[SAME.get(name, name)] += 1
        stack.extend(n for n, _ in node.next_functions)
    return kinds


@pytest.mark.parametrize("name", ["tiny", "llama-tiny"])
def test_the_calibrated_layer_runs_the_reference_layers_operators(name):
    cfg = model_config(name)
    x = torch.randn(1, cfg.seq_length, cfg.hidden_size, requires_grad=True)
    reference = _operators(Block(cfg, 0), x)
    calibrated = _operators(LocalLayer(shape_from(cfg), 1), x)
    assert calibrated == reference, (dict(reference - calibrated), dict(calibrated - reference))
    if cfg.rope_theta:  # RoPE's rotation is among them (it was once missing)
        assert reference["CatBackward0"] >= 2
