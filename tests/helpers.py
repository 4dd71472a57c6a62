"""Helpers for the tests (imported explicitly; fixtures live in conftest.py)."""
from __future__ import annotations

import torch

from impls.expert.dispatch import moe_tokens
from parbench.config import CaseConfig
from parbench.model import MLP
from parbench.moe import MoE, RoutingGroups
from parbench.results import RankResult
from parbench.runner import run_per_rank
from parbench.scheme import get_scheme
from parbench.verdict import Merged, merge_ranks


def run_on_pool(pools, case: CaseConfig) -> tuple[Merged, list[RankResult]]:
    """Run a case on the session pool for its world size; return (merged, per_rank)."""
    cls = get_scheme(case.run.scheme)
    pool = None if cls.isolated else pools(case.parallel.world_size)
    per_rank = run_per_rank(case, pool)
    names = sorted(cls.reference(case, 1).params[0])
    return merge_ranks(per_rank, names), per_rank


def assert_wire_and_calls_per_step(pred, per_rank: list[RankResult]) -> None:
    """Every rank's wire bytes and calls per axis equal the prediction's on every checked
    step (an axis one side lacks counts 0 bytes; axes with no calls are left out)."""
    for r in per_rank:
        for step, (wire, calls) in enumerate(zip(r.wire_by_axis_per_step,
                                                 r.calls_by_axis_per_step)):
            want_w, want_c = pred.wire_at(step)[r.rank], pred.calls_at(step)[r.rank]
            for axis in set(wire) | set(want_w):
                assert wire.get(axis, 0.0) == want_w.get(axis, 0.0), (r.rank, step, axis, wire)
            assert {a: c for a, c in calls.items() if c} == want_c, (r.rank, step, calls)


def moe_layer_against_reference(cfg, b: int, s: int, dispatch=None) -> tuple[dict, MoE]:
    """One process, every expert local: ``moe_tokens`` (with ``dispatch``, default
    ``ExpertDispatch``) and ``parbench.moe.MoE`` on the same tokens ``[b, s, h]`` (seed 0)
    and routing groups of two rows; output, input gradient, router gradient and every expert
    weight gradient are asserted equal. Returns ``(stats, reference layer)``."""
    torch.manual_seed(0)
    h = cfg.hidden_size
    ref = MoE(cfg, RoutingGroups(rows=2))
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(b, s, h, requires_grad=True)
    y_ref = ref(x)
    y_ref.square().sum().backward()
    xt = x.detach().transpose(0, 1).reshape(s * b, h).requires_grad_()
    experts = [MLP(cfg) for _ in range(cfg.num_experts)]
    for e, ex in enumerate(experts):
        ex.load_state_dict(ref.experts[e].state_dict())
    w = ref.router.weight.detach().clone().requires_grad_()
    y, stats = moe_tokens(xt, w, experts, 0, cfg, RoutingGroups(rows=2).ids(b, s), None, 1,
                          1.0, dispatch=dispatch)
    y.square().sum().backward()
    torch.testing.assert_close(y.view(s, b, h).transpose(0, 1), y_ref)
    torch.testing.assert_close(xt.grad.view(s, b, h).transpose(0, 1), x.grad)
    torch.testing.assert_close(w.grad, ref.router.weight.grad)
    for e in range(cfg.num_experts):
        for name in ("fc1", "fc2"):
            torch.testing.assert_close(getattr(experts[e], name).weight.grad,
                                       getattr(ref.experts[e], name).weight.grad)
    return stats, ref
