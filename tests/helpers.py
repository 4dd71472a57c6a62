"""Helpers for the tests (imported explicitly; fixtures live in conftest.py)."""
from __future__ import annotations

import torch

from impls.expert.dispatch import moe_tokens
from parbench.config import CaseConfig, RunConfig
from parbench.model import MLP
from parbench.model.moe import MoE, RoutingGroups
from parbench.results import RankResult
from parbench.runner import run_per_rank
from parbench.registry import get_scheme
from parbench.verdict import Merged, compare, merge_ranks

#: the subprocess timeout of the CLI tests: a net against a hang, not a bound on wall time (no
#: test asserts one). On a 2-core machine whose cores another process keeps busy, a two-case
#: torchrun run that takes 8 s quiet took more than 180 s; the ranks' own hang detection
#: (60 s without progress locally, the process group's 600 s timeout under torchrun) ends a
#: real hang well before this
SUBPROCESS_TIMEOUT_S = 900


def run_on_pool(pools, case: CaseConfig) -> tuple[Merged, list[RankResult]]:
    """Run a case on the session pool for its world size; return (merged, per_rank)."""
    cls = get_scheme(case.run.scheme)
    pool = None if cls.isolated else pools(case.layout.world_size)
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


def assert_layer_activations(per_rank: list[RankResult], measured: str = "act_layer_bytes",
                             formula: str = "act_layer_formula") -> None:
    """Every rank's bytes one layer keeps for backward (saved-tensor hooks, ``measured``)
    equal the activation formula's (``formula``: ``analytic.activations``)."""
    for r in per_rank:
        assert r.metrics[measured] == r.metrics[formula], (r.rank, r.metrics)


def moe_layer_against_reference(cfg, b: int, s: int, dispatch=None) -> tuple[dict, MoE]:
    """One process, every expert local: ``moe_tokens`` (with ``dispatch``, default
    ``ExpertDispatch``) and ``parbench.model.moe.MoE`` on the same tokens ``[b, s, h]`` (seed 0)
    and routing groups of two rows; output, input gradient, router gradient and every expert
    weight gradient are asserted equal by the verdict's rule (``assert_close_by_the_verdict``:
    the two paths sum over tokens in different orders). Returns ``(stats, reference layer)``."""
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
    assert_close_by_the_verdict(y.view(s, b, h).transpose(0, 1), y_ref, "output")
    assert_close_by_the_verdict(xt.grad.view(s, b, h).transpose(0, 1), x.grad, "input grad")
    assert_close_by_the_verdict(w.grad, ref.router.weight.grad, "router grad")
    for e in range(cfg.num_experts):
        for name in ("fc1", "fc2"):
            assert_close_by_the_verdict(getattr(experts[e], name).weight.grad,
                                        getattr(ref.experts[e], name).weight.grad,
                                        f"experts.{e}.{name}.weight grad")
    return stats, ref


def assert_close_by_the_verdict(ours: torch.Tensor, ref: torch.Tensor, what: str,
                                run: RunConfig | None = None) -> None:
    """``ours`` against ``ref`` by the verdict's rule (``parbench.verdict.compare``, the
    RunConfig docstring): max|ours - ref| <= atol + rtol * max|ref| over the tensor, with the
    run's tolerances for losses and gradients on identical weights (RunConfig defaults: rtol
    1e-5, atol 1e-6 in fp32).

    Why not ``torch.testing.assert_close``: its fp32 defaults (atol 1e-5 + rtol 1.3e-6 * |x|,
    element by element) are torch's, not parbench's, and elementwise. fp32 reduction-order
    noise scales with the magnitude of the summed terms, i.e. with the tensor's scale, not
    each element's: an element where large addends cancel keeps their rounding. The two MoE
    paths sum the router gradient over tokens in different orders (position-major against
    batch-major), and AMD and Intel vectorised kernels round differently: on an AMD EPYC the
    router gradient differed by 2.1e-5 at max|grad| ~170 (1.2e-7 of the tensor's scale, an
    ulp or so), which failed the elementwise 1e-5 on every run."""
    run = run or RunConfig()
    res = compare({what: ours}, {what: ref}, run.rtol, run.atol)
    assert res["ok"], f"{what}: {res['worst']} (rule: max|ours - ref| <= atol + rtol max|ref|)"
