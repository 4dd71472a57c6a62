"""The live-storage tracker (``parbench.memory.live_model_states``) follows every way a scheme
object can hold a tensor: a full parameter copy kept in a ``functools.partial``, a closure
cell, a bound method, an optimizer's hook or a class attribute is measured as ``other`` with exactly the copy's
bytes (issue 20, sec. 7), a list the scheme declares cannot hide one, and what a scheme keeps
only for the checks (``KeptForChecks``) is attributed to ``checks``."""
from __future__ import annotations

import functools

import pytest
import torch

from parbench.memory import KeptForChecks, live_model_states, model_states


class _Holder:
    """A scheme's state: a model, its AdamW (moments after one step) and gradients."""

    def __init__(self):
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.model(torch.randn(2, 6)).sum().backward()
        self.opt.step()

    def state_tensors(self):
        return None


def _param_bytes(holder) -> int:
    return sum(p.numel() * p.element_size() for p in holder.model.parameters())


def _full_copy(holder) -> list[torch.Tensor]:
    return [p.detach().clone() for p in holder.model.parameters()]


def _in_partial(h):
    h.apply_later = functools.partial(torch.cat, _full_copy(h))


def _in_closure(h):
    copy = _full_copy(h)
    h.restore = lambda: copy


def _in_bound_method(h):
    class Snapshot:
        def __init__(self, tensors):
            self.tensors = tensors

        def restore(self):
            return self.tensors

    h.restore = Snapshot(_full_copy(h)).restore  # only the bound method refers to it


def _in_class_attribute(h):
    type(h).snapshots = [_full_copy(h)]


def _in_builtin_bound_method(h):
    h.add_back = torch.cat([p.detach().reshape(-1) for p in h.model.parameters()]).add_


def _in_optimizer_hook(h):
    copy = _full_copy(h)
    h.opt.register_step_pre_hook(lambda opt, args, kwargs: copy)


HOLDERS = {"partial": _in_partial, "closure": _in_closure, "bound method": _in_bound_method,
           "optimizer hook": _in_optimizer_hook,
           "class attribute": _in_class_attribute,
           "tensor's bound builtin": _in_builtin_bound_method}


@pytest.mark.parametrize("where", HOLDERS)
def test_a_full_copy_is_other_wherever_it_is_held(where):
    cls = type("Scheme", (_Holder,), {})  # a fresh class: a class attribute stays local
    clean, leaky = cls(), cls()
    base = live_model_states(clean)
    assert base["other"] == 0 and base["params"] == _param_bytes(clean), base
    HOLDERS[where](leaky)
    got = live_model_states(leaky)
    assert got["other"] == _param_bytes(leaky), (where, got)
    assert {k: got[k] for k in ("params", "grads", "optimizer")} == \
        {k: base[k] for k in ("params", "grads", "optimizer")}


def test_a_declared_list_cannot_hide_a_copy():
    h = _Holder()
    _in_closure(h)
    h.state_tensors = lambda: {"params": list(h.model.parameters())}
    assert model_states(h)["other"] == _param_bytes(h)


def test_what_is_kept_for_the_checks_is_attributed_to_checks_not_other():
    h = _Holder()
    h.captured = KeptForChecks({n: p.grad.clone() for n, p in h.model.named_parameters()})
    got = live_model_states(h)
    assert got["other"] == 0 and got["checks"] == _param_bytes(h), got
    # a parameter listed there is still a parameter, and a copy also held elsewhere is other
    h.captured["w"] = next(h.model.parameters())
    h.also = [h.captured[next(iter(h.captured))]]
    again = live_model_states(h)
    assert again["params"] == got["params"]
    assert 0 < again["other"] < _param_bytes(h) and again["other"] + again["checks"] == \
        _param_bytes(h), again


def test_no_checks_key_when_nothing_is_kept_for_them():
    assert "checks" not in live_model_states(_Holder())
