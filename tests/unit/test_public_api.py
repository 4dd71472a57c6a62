"""The public API a user's scheme is written against: these names, importable from
``parbench`` itself, are the contract (README, "Your own scheme"). Removing or renaming one
breaks users, so the set is pinned here."""
from parbench import (CaseConfig, ConfigError, Prediction, Scheme, SchemeContext,  # noqa: F401
                      build_model, build_stage, dp_slice, make_optimizer, microbatches,
                      register, unrecorded)

PUBLIC = {"Scheme", "SchemeContext", "Prediction", "register", "get_scheme", "build_model",
          "build_stage", "make_optimizer", "dp_slice", "microbatches", "unrecorded",
          "CaseConfig", "ConfigError"}


def test_public_names_are_pinned():
    import parbench
    assert PUBLIC <= set(parbench.__all__)


def test_a_scheme_written_with_public_names_only_is_accepted():
    import torch

    from parbench.scheme import _check_scheme_class

    class Mine(Scheme):
        family = "data"

        def train_step(self, inputs, targets, step):
            return 0.0

        def full_params(self):
            return {}

        def full_grads(self):
            return {}

    _check_scheme_class(Mine, "Mine")
    x = torch.arange(8).view(4, 2)
    assert dp_slice(x, 1, 2).tolist() == [[4, 5], [6, 7]]
    assert len(microbatches(x, x, 2)) == 2
    assert Scheme.state_tensors(Mine.__new__(Mine)) is None
