"""The hybrid on DeepSeek-V3's MoE blocks (``deepseek-tiny``: first layer dense, 8
fine-grained experts top-2, one shared expert, the sigmoid router with the balancing bias, 2
groups keeping 1; DeepSeek-V3 Technical Report, arXiv 2412.19437, Sec. 2.1.2; issue 21) built
wrongly, on the family's tp 2 x dp 2 x ep 2 case:

- the shared expert's gradients left out of the dense gradients' all-reduce over dp x cp
  (a group of their own with no process group): each rank steps on its own tokens' gradient;
- the balancing bias updated from the rank's own loads: the loads are all-reduced over the
  stage's tp x dp x cp ranks into a copy and the update reads the local tensor, so the
  ranks' biases drift apart from each other and from the golden model's.
"""
from __future__ import annotations

import torch.distributed as dist

from impls.hybrid.balance import LOAD_AXIS
from impls.hybrid.scheme import HybridScheme

from .catalogue import mutant

#: the preset and its expert count (the family's case sets num_experts=4)
DEEPSEEK = {"model": "deepseek-tiny", "num_experts": "8"}


@mutant("hybrid-shared-expert-grad-not-reduced", base="hybrid", overrides=DEEPSEEK,
        bug="shared expert's gradients not reduced over dp x cp: kept out of the dense "
            "all-reduce in a group of their own, stepped on each rank's local gradient")
class HybridSharedGradNotReduced(HybridScheme):
    def __init__(self, ctx):
        super().__init__(ctx)
        shared = [p for s in self.slots.values()
                  for n, (p, _) in s.module.shards().items() if ".mlp.shared_expert." in n]
        mine = {id(p) for p in shared}
        dense = self.groups[0]
        dense.params = [p for p in dense.params if id(p) not in mine]
        # the optimizer already steps them (ZeRO-0, fp32: the masters are the parameters)
        self.groups.append(self.group_class(shared, None, 1, 0, 1, 0, self.dtype))


def _local_load(local, mesh):
    total = local.clone()  # a copy: the all-reduce never reaches ``local``
    if mesh.size(LOAD_AXIS) > 1:
        dist.all_reduce(total, group=mesh.group(LOAD_AXIS))
    return local


@mutant("hybrid-bias-local-load", base="hybrid", overrides=DEEPSEEK,
        bug="balancing bias updated from this rank's local loads: the all-reduce over "
            "tp x dp x cp fills a copy, the update reads the local tensor")
class HybridBiasLocalLoad(HybridScheme):
    global_load = staticmethod(_local_load)
