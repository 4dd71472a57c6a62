"""DeepSpeed-Ulysses (``DistributedAttention`` + engine) and torch ``context_parallel`` on the
same cases as our Ulysses and ring attention: each equals the golden run and agrees with ours.

DeepSpeed's all-to-alls are the paper's (and ours): 4 per layer each way of the rank's
b (s/P) h shard -- asserted, since that is what the issue-4217 comparison leans on. torch's
traffic is printed, not asserted: it gathers K/V once per attention and rotates dK/dV with
all-to-alls (a finding beside the native closed form, not an error).

yunchang's USP (``baseline.yunchang.usp``, the optional extra ``yunchang``; skipped with the
reason without it): its groups are context.usp's grid, its CPU block kernel (the shim) is
exact attention, its Ulysses all-to-alls are the closed form; its forward equals the golden
run and its fp32 gradients do not (the finding, ``scripts/yunchang_fp32_repro.py``).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from parbench.analytic import context as closed
from parbench.config import CaseConfig
from parbench.layout import Layout
from parbench.overrides import apply_overrides
from parbench.registry import get_scheme
from tests.helpers import assert_close_by_the_verdict, run_on_pool

from impls.baselines.yunchang_kernels import cpu_flash_backward, cpu_flash_forward
from impls.context.schemes import USPScheme

BASE = {"model": "tiny", "num_microbatches": "2", "steps": "3", "timed_steps": "0",
        "param_atol": "1e-3"}  # see PARAM_ATOL in tests/equivalence/test_context.py
LOSS_AGREE = 1e-5


def case_for(scheme: str, **ov) -> CaseConfig:
    case = apply_overrides(CaseConfig(), {**BASE, "scheme": scheme,
                                          **{k: str(v) for k, v in ov.items()}})
    get_scheme(scheme).check(case)
    return case


def agree(ours, theirs) -> None:
    assert ours.equivalent and theirs.equivalent
    for a, b in zip(ours.losses, theirs.losses):
        assert abs(a - b) <= LOSS_AGREE * abs(a), (ours.losses, theirs.losses)


def test_deepspeed_ulysses_equals_golden_and_native(pools):
    pytest.importorskip("deepspeed")
    assert get_scheme("baseline.deepspeed.ulysses").isolated
    ours, _ = run_on_pool(pools, case_for("context.ulysses", cp=2))
    case = case_for("baseline.deepspeed.ulysses", cp=2)
    theirs, per_rank = run_on_pool(pools, case)  # isolated: fresh ranks
    agree(ours, theirs)
    pred = get_scheme("context.ulysses").predict(case)
    for r in per_rank:  # DeepSpeed's all-to-alls: exactly the closed form's
        assert r.wire_by_axis_per_step[-1]["cp"] == pred.wire_bytes[r.rank]["cp"]
        assert r.calls_by_axis_per_step[-1]["cp"] == pred.calls[r.rank]["cp"]
    print("deepspeed ulysses: wire", theirs.wire_by_axis[0], "states",
          theirs.model_state_bytes[0], "ours", ours.wire_by_axis[0])


def test_torch_context_parallel_equals_golden_and_native(pools):
    ours, _ = run_on_pool(pools, case_for("context.ring-attention", cp=2, dp=2))
    theirs, per_rank = run_on_pool(pools, case_for("baseline.torch.context_parallel", cp=2,
                                                   dp=2))
    agree(ours, theirs)
    ops = sorted({(x["op"], x["axis"], x["message_bytes"]) for x in per_rank[0].ledger})
    assert theirs.wire_by_axis[0].get("cp", 0) > 0, "torch's ring traffic must be in the ledger"
    print("torch context_parallel ops:", ops, "wire", theirs.wire_by_axis[0],
          "ours", ours.wire_by_axis[0])


def _skip_without_yunchang():
    missing = get_scheme("baseline.yunchang.usp").unavailable()
    if missing:
        pytest.skip(missing)


@pytest.mark.parametrize("cp,u,dp", [(4, 2, 1), (4, 2, 2), (8, 4, 1), (4, 1, 1)])
def test_yunchang_groups_are_the_usp_grid(monkeypatch, cp, u, dp):
    """``set_seq_parallel_pg`` would make exactly context.usp's Ulysses and ring groups."""
    _skip_without_yunchang()
    import torch.distributed as dist
    from yunchang import set_seq_parallel_pg
    made = []
    monkeypatch.setattr(dist, "new_group", lambda ranks: made.append(list(ranks)))
    set_seq_parallel_pg(u, cp // u, 0, cp * dp)
    uly, ring = USPScheme.grid_partition(Layout(cp=cp, dp=dp).groups("cp"), u)
    assert sorted(made) == sorted(uly + ring)


@pytest.mark.parametrize("causal,kv_heads", [(True, 4), (False, 2)])
def test_yunchang_cpu_block_kernel_is_attention(causal, kv_heads):
    """The shim under flash-attn's contract against autograd through SDPA (GQA: query head i
    reads K/V head i // group), by the verdict's rule."""
    torch.manual_seed(0)
    q, dout = torch.randn(2, 6, 4, 8), torch.randn(2, 6, 4, 8)
    k, v = torch.randn(2, 6, kv_heads, 8), torch.randn(2, 6, kv_heads, 8)
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    g = 4 // kv_heads
    heads = [ref_in[0].transpose(1, 2)] + [t.transpose(1, 2).repeat_interleave(g, 1)
                                           for t in ref_in[1:]]
    ref = F.scaled_dot_product_attention(*heads, is_causal=causal).transpose(1, 2)
    ref.backward(dout)
    out, lse = cpu_flash_forward(q, k, v, causal=causal)
    bufs = [torch.empty_like(t) for t in (q, k, v)]
    cpu_flash_backward(dout, q, k, v, out, lse, *bufs, 0.0, None, causal, (-1, -1), None,
                       None, False)
    assert lse.shape == (2, 4, 6)
    assert_close_by_the_verdict(out, ref.detach(), "out")
    for name, mine, t in zip(("dq", "dk", "dv"), bufs, ref_in):
        assert_close_by_the_verdict(mine, t.grad, name)


def test_yunchang_usp_forward_equals_golden_fp32_gradients_do_not(pools):
    """The finding: step 0's loss (the forward on the golden weights) is golden's, the fp32
    gradients are not (the ring backward's aliased accumulators); the Ulysses all-to-alls are
    context.usp's closed form, the ring sends more (dK, dV make r hops, not r - 1)."""
    _skip_without_yunchang()
    case = case_for("baseline.yunchang.usp", cp=4, cp_ulysses=2, steps=2)
    theirs, per_rank = run_on_pool(pools, case)
    golden = get_scheme("context.usp").reference(case, 1).losses[0]
    assert abs(theirs.losses[0] - golden) <= LOSS_AGREE * abs(golden), (theirs.losses, golden)
    assert not theirs.equivalent and theirs.first_failure.what == "gradient", \
        theirs.first_failure
    pred = get_scheme("context.usp").predict(case)
    for r in per_rank:
        wire, want = r.wire_by_axis_per_step[-1], pred.wire_bytes[r.rank]
        assert wire[closed.ULYSSES_AXIS] == want[closed.ULYSSES_AXIS]
        assert r.calls_by_axis_per_step[-1][closed.ULYSSES_AXIS] == \
            pred.calls[r.rank][closed.ULYSSES_AXIS]
        assert wire[closed.RING_AXIS] > want[closed.RING_AXIS], (wire, want)
    print("yunchang usp: first failure", theirs.first_failure, "wire", theirs.wire_by_axis[0],
          "closed form", pred.wire_bytes[0])
