"""The hybrid on DeepSeek-V3's blocks whole (``deepseek-v3-tiny``: multi-head latent
attention, DeepSeek-V2 arXiv 2405.04434 Sec. 2.1.2-2.1.3, around DeepSeek's MoE; issue 21)
built wrongly, on the family's tp 2 x dp 2 x ep 2 case with sequence parallelism: MLA's down
projections and latent norms, duplicated on every tp rank, run on the rank's sequence shard,
so their gradients are partial over tp and join the once-per-step tp sum of the replicated
parameters (Megatron-Core's sequence-parallel gradients); the bug leaves them out (a filter
of the replicated parameters by the dense block's names), so each tp rank steps on its own
shard's gradient."""
from __future__ import annotations

from impls.hybrid.model import HybridStage
from impls.hybrid.scheme import HybridScheme

from .catalogue import mutant
from .mutants_expert_mla import LATENTS

#: the preset, its expert count (the family's case sets num_experts=4), sp on
DEEPSEEK_V3_SP = {"model": "deepseek-v3-tiny", "num_experts": "8", "sp": "true", "etp": "1"}


class _LatentsNotSummed(HybridStage):
    def tp_partial_params(self):
        latents = {id(self.p(n)) for n in self.placements if any(k in n for k in LATENTS)}
        # the bug: the replicated latents' partial gradients are never summed over tp
        return [p for p in super().tp_partial_params() if id(p) not in latents]


@mutant("hybrid-mla-latents-not-summed-over-tp", base="hybrid", overrides=DEEPSEEK_V3_SP,
        bug="under sp, MLA's down projections and latent norms (duplicated over tp) left "
            "out of the tp sum of the replicated parameters' partial gradients")
class HybridMLALatentsNotSummed(HybridScheme):
    stage_class = _LatentsNotSummed
