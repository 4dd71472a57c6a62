"""The public API a user's scheme is written against: these names, importable from
``parbench`` itself, are the contract (docs/own-scheme.md, "The contract"). Removing or
renaming one breaks users, so the set is pinned here, and the page's names and its example
scheme are held to it."""
import re
from pathlib import Path

from parbench import (CaseConfig, ConfigError, Prediction, Scheme, SchemeContext,  # noqa: F401
                      build_model, build_stage, dp_slice, make_optimizer, microbatches,
                      register, unrecorded)

OWN_SCHEME = Path(__file__).resolve().parents[2] / "docs" / "own-scheme.md"

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


def test_the_contract_the_manual_states_is_the_public_api():
    """The names docs/own-scheme.md lists as the contract are exactly the pinned ones (but
    ``get_scheme``, which a scheme does not need)."""
    text = OWN_SCHEME.read_text()
    stated = re.search(r"`from parbench import ([^`]+)`", text)
    assert stated, "docs/own-scheme.md does not state the public names"
    names = {n.strip() for n in stated.group(1).split(",")}
    assert names == PUBLIC - {"get_scheme"}


def test_the_manual_s_example_scheme_is_accepted():
    """The example of docs/own-scheme.md, run as a module: it imports public names only, is
    an acceptable Scheme, and reads only what SchemeContext has."""
    from parbench.scheme import _check_scheme_class

    blocks = re.findall(r"```python\n(# mine.py.*?)```", OWN_SCHEME.read_text(), re.DOTALL)
    assert len(blocks) == 1, "docs/own-scheme.md has no '# mine.py' example"
    code = blocks[0]
    for module in re.findall(r"^from (\S+) import", code, re.MULTILINE):
        assert module in ("parbench", "torch.distributed"), module
    namespace: dict = {}
    exec(compile(code, str(OWN_SCHEME), "exec"), namespace)  # noqa: S102 (the page's code)
    _check_scheme_class(namespace["MyDDP"], "docs/own-scheme.md")
    from types import SimpleNamespace
    ctx = SchemeContext(case=CaseConfig(), mesh=SimpleNamespace(rank=0), device="cpu",
                        timeline=None)
    for attr in sorted(set(re.findall(r"\bctx\.(\w+)", code))):
        try:
            getattr(ctx, attr)
        except AttributeError as e:
            raise AssertionError(f"the example reads ctx.{attr}: {e}") from None
