"""``MyDDP`` with a subtle bug: weight decay added to the local gradient before the
all-reduce (L2 regularisation, as Adam + L2 does it), although AdamW already decays the
weights itself (decoupled, Loshchilov & Hutter 2019). The decay is applied twice, and the
first time it goes through Adam's normalisation.

Nothing looks wrong: the run trains, the step-0 losses are identical and later ones differ in
the fourth decimal, and the traffic is unchanged. The golden comparison sees it at step 0: the
gradients the step used differ from the single-device model's by ``weight_decay * |p|``
(1e-2 on a LayerNorm weight of 1, against a tolerance of about 1e-6).

    parbench verify scheme=my_ddp.buggy:BuggyDDP      # exit status 3, the tensor named
"""
from __future__ import annotations

from .ddp import MyDDP


class BuggyDDP(MyDDP):
    name = "my_ddp.buggy"
    description = "my DDP with weight decay also applied to the gradient (a bug)"

    def average_gradients(self) -> None:
        wd = self.ctx.run.weight_decay
        for p in self.params:
            p.grad.add_(p.detach(), alpha=wd)  # the bug: AdamW decays the weights already
        super().average_gradients()
