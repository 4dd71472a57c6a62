"""Bugs in bf16 rows (issue 20, sec. 4): each must be caught by the tolerances derived from the
step's own rounding noise (``verdict.precision``) or by the update check, where the stated
bf16 tolerances of before (rtol 5e-2, atol 1e-2) let small tensors through whole.

- a weight decay dropped on the fp32 masters (the update check: its tolerance is a few ulps of
  fp32 whatever the compute dtype);
- one gradient summed over dp instead of averaged (a LayerNorm bias, a tensor whose gradient is
  small next to atol 1e-2);
- the sequence-parallel LayerNorm gradients left partial over tp (each rank's LayerNorm sees
  only its sequence shard, so its gradients must be summed over tp: Korthikanti et al. 2022,
  Sec. 4.2.2);
- the optimizer rebuilt without its moments after the checked steps, in a long timed run
  (12 timed steps): the same traffic, so only the final check sees it, at the tolerance
  derived from the timed steps' own noise (``verdict.precision.final_tolerances``).
"""
from __future__ import annotations

from impls.hybrid.model import HybridStage
from impls.hybrid.scheme import HybridScheme
from impls.zero.replicated import Zero1, Zero2

from .catalogue import mutant
from .optimizers import make_buggy_optimizer

#: the bf16 row's fields (the data family's small case, bf16 compute, stated tolerances left at
#: the fp32 defaults: the derived ones replace them)
BF16 = {"dtype": "bf16"}

#: the tensor whose gradient is left un-averaged: a LayerNorm bias, whose gradient's scale is
#: about 2e-3 on the small case (inside the old atol 1e-2 whatever its value)
UNAVERAGED = "blocks.1.ln1.bias"


@mutant("zero1-bf16-no-wd", base="zero.1", overrides=BF16,
        bug="bf16 compute, fp32 masters: weight decay dropped on the master shards")
class Zero1Bf16NoWd(Zero1):
    def make_optimizer(self):
        self.opt = make_buggy_optimizer(self.masters, self.ctx.run, "no-wd")


@mutant("zero2-bf16-one-grad-summed", base="zero.2", overrides=BF16,
        bug=f"bf16 compute: the gradient of {UNAVERAGED} is summed over dp, not averaged")
class Zero2Bf16OneGradSummed(Zero2):
    def _on_grad(self, p):
        if self._sync and p is dict(self.model.named_parameters())[UNAVERAGED]:
            p.grad.mul_(self.dp_size)  # divided by dp with the rest: a sum, not a mean
        super()._on_grad(p)


class _SPLayerNormPartial(HybridStage):
    def tp_partial_params(self):
        """The bug: only the routers are summed over tp; the replicated LayerNorm weights and
        biases keep the gradient of this rank's sequence shard."""
        norms = {id(self.p(n)) for n in self.placements if ".ln" in n}
        return [p for p in super().tp_partial_params() if id(p) not in norms]


@mutant("hybrid-bf16-sp-ln-not-reduced", base="hybrid",
        overrides={**BF16, "sp": "true", "dp": "1", "ep": "1", "num_experts": "0"},
        bug="bf16, tp=2 with sequence parallelism: the LayerNorm gradients are not "
            "all-reduced over tp (each rank keeps its sequence shard's part)")
class HybridBf16SPLayerNorm(HybridScheme):
    stage_class = _SPLayerNormPartial


@mutant("zero1-bf16-optimizer-reset-after-checked", base="zero.1",
        overrides={**BF16, "timed_steps": "12"},
        bug="bf16, 12 timed steps: from the first timed step on the optimizer is rebuilt "
            "without its moments (same traffic, other parameters)")
class Zero1Bf16OptimizerReset(Zero1):
    def train_step(self, inputs, targets, step):
        if step == self.ctx.run.steps:
            self.make_optimizer()
        return super().train_step(inputs, targets, step)
