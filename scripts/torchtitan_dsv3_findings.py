"""Reproducers (findings, torchtitan 0.3.0's DeepSeek-V3, torch 2.13.0+cpu), one process;
each prints what it found. ``baseline.torchtitan.deepseek-v3`` declares both
(``Scheme.known_finding``): its MoE rows are not equivalent to the golden run.

1. ``bf16``: ``GroupedExperts.forward`` (torchtitan/models/common/moe.py) casts the routed
   tokens and the expert weights to bfloat16 for its grouped matmuls whatever the training
   dtype, so in fp32 training the routed experts' gradients carry bf16 rounding. Shown on
   ``deepseek-v3-tiny`` with the reference weights: the experts' gradients against the
   reference model's, with torchtitan's forward and with the same grouped matmuls in fp32
   (``fp32_experts``), each beside the verdict's tolerance (atol 1e-6 + rtol 1e-5 max|g|).
2. ``bias``: the auxiliary-loss-free bias update (``register_moe_load_balancing_hook``,
   torchtitan/components/optimizer/optimizer.py) adds delta - mean(delta), delta = gamma
   sign(mean load - load); the DeepSeek-V3 report (arXiv 2412.19437, Sec. 2.1.2) adds
   gamma sign(mean load - load_i) per expert, no mean removed. Shown with one MoE layer's
   load set by hand (3 experts over the mean, 5 under it), torchtitan's own hook beside
   parbench's ``updated_bias`` (the report's rule).

Run: ``PYTHONPATH=. python scripts/torchtitan_dsv3_findings.py``.
"""
from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from parbench.config import model_preset
from parbench.model import build_model
from parbench.model.router import updated_bias

from impls.baselines.torchtitan_dsv3 import PreStepHooks
from impls.baselines.torchtitan_dsv3_model import fp32_experts, from_titan, titan_model

RTOL, ATOL = 1e-5, 1e-6


def expert_grad_error(cfg, experts=contextlib.nullcontext) -> float:
    """The largest excess of an expert gradient's error over the verdict's tolerance
    (> 1: outside it), torchtitan's model against the reference on one batch."""
    ref = build_model(cfg, seed=3)
    with experts():
        titan = titan_model(cfg, ref)
        g = torch.Generator().manual_seed(0)
        x, y = (torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=g)
                for _ in "xy")
        ref(x, y).backward()
        F.cross_entropy(titan(x).flatten(0, 1).float(), y.flatten()).backward()
    grads = from_titan(cfg, {n: p.grad for n, p in titan.named_parameters()})
    return max(float((grads[n] - p.grad).abs().max() / (ATOL + RTOL * p.grad.abs().max()))
               for n, p in ref.named_parameters() if ".mlp.experts." in n)


def titan_bias_update(cfg, load: torch.Tensor) -> torch.Tensor:
    """torchtitan's own hook on a model whose first MoE layer routed ``load``."""
    from torchtitan.components.optimizer import register_moe_load_balancing_hook
    titan = titan_model(cfg, build_model(cfg, seed=3))
    moe = titan.layers[str(cfg.moe_first_dense)].moe
    moe.tokens_per_expert_E.copy_(load)
    hooks = PreStepHooks()
    one_rank = SimpleNamespace(get_optional_mesh=lambda name: None, ep_enabled=False, tp=1)
    register_moe_load_balancing_hook(hooks, [titan], one_rank)
    hooks.run()
    return moe.expert_bias_E.clone()


def main() -> None:
    cfg = model_preset("deepseek-v3-tiny")
    own, fp32 = expert_grad_error(cfg), expert_grad_error(cfg, fp32_experts)
    print(f"bf16: routed experts' gradients, max error / tolerance: torchtitan {own:.3g}, "
          f"its grouped matmuls in fp32 {fp32:.3g} "
          f"({'FINDING: bf16 experts' if own > 1 >= fp32 else 'not reproduced'})")
    load = torch.tensor([9.0, 7.0, 6.0, 2.0, 2.0, 1.0, 1.0, 0.0])
    theirs = titan_bias_update(cfg, load)
    report = updated_bias(torch.zeros_like(theirs), load, cfg.moe_bias_update_rate)
    print(f"bias: load {load.tolist()}: torchtitan {theirs.tolist()}, DeepSeek-V3's rule "
          f"{report.tolist()} ({'FINDING: mean removed' if not torch.equal(theirs, report) else 'same'})")


if __name__ == "__main__":
    main()
