"""``Scheme.state_tensors``: a scheme may list its own model states; each storage is counted
once, in the first category that lists it."""
import pytest
import torch

from parbench.memory import declared_model_states


def test_declared_states_count_each_storage_once():
    w = torch.zeros(10)
    flat = torch.zeros(8)
    got = declared_model_states({"params": [w, flat[:4]], "grads": [flat[4:], w],
                                 "optimizer": [torch.zeros(3, dtype=torch.float64)]})
    # flat's storage is claimed by params first (32 B), w once (40 B)
    assert got == {"params": 40 + 32, "grads": 0, "optimizer": 24, "other": 0}


def test_declared_states_reject_unknown_categories():
    with pytest.raises(ValueError, match="moments"):
        declared_model_states({"moments": [torch.zeros(1)]})
