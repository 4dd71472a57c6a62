"""Uneven pipeline stages (issue 21; ``first_stage_layers`` / ``last_stage_layers``,
Megatron-Core's ``num_layers_in_first/last_pipeline_stage``): the ways a trainer places the
layers of an uneven split wrongly.

- Megatron-LM issue 1584 (``get_transformer_layer_offset``, fixed later): with interleaving and
  only the last stage set, every rank after the first computed its chunk's offset as if the
  first stage were set too (its middle rank index one short), so ranks 1.. built the layers of
  the rank before them: some layers twice, some never. Case: 10 layers on pp=3, vpp=2, the
  last rank 2 layers (chunks 2 2 1 | 2 2 1).
- The two end ranks' counts swapped (the first rank built with ``last_stage_layers``): every
  layer is still trained once, in order, so the numbers match the golden run; only the model
  states per rank differ from the closed form's -- a bug the byte checks alone can catch.
"""
from __future__ import annotations

from parbench.model import GPTStage
from impls.pipeline import SCHEMES

from .catalogue import mutant


def _stage(scheme, lo: int, hi: int, stage: int) -> GPTStage:
    n = scheme.schedule.num_stages
    return GPTStage(scheme.ctx.model, lo, hi, first=stage == 0, last=stage == n - 1,
                    seed=scheme.ctx.run.seed)


@mutant("interleaved-uneven-offset-one-rank-short", base="pipeline.interleaved",
        overrides={"pp": 3, "vpp": 2, "num_layers": 10, "last_stage_layers": 2,
                   "num_microbatches": 6},
        bug="with only the last stage set, ranks after the first place their chunks one "
            "middle rank too early (Megatron-LM issue 1584)")
class InterleavedUnevenOffset(SCHEMES["interleaved"]):
    def build_stage(self, stage: int):
        lay, L = self.ctx.layout, self.ctx.model.num_layers
        p, v, last = lay.pp, lay.vpp, lay.last_stage_layers
        chunk, rank = stage // p, stage % p
        mid = (L - last) // (p - 1) // v  # a middle rank's chunk
        per_round = mid * (p - 1) + last // v
        lo = chunk * per_round + max(rank - 1, 0) * mid  # rank - 1: as if first were set
        n = last // v if rank == p - 1 else mid
        return _stage(self, lo, lo + n, stage)


@mutant("1f1b-uneven-ends-swapped", base="pipeline.1f1b",
        overrides={"pp": 3, "num_layers": 8, "first_stage_layers": 1,
                   "last_stage_layers": 3},
        bug="the first rank is built with last_stage_layers and the last with "
            "first_stage_layers (every layer still once, in order)")
class OneFOneBUnevenEndsSwapped(SCHEMES["1f1b"]):
    def build_stage(self, stage: int):
        lay, L = self.ctx.layout, self.ctx.model.num_layers
        swapped = [lay.last_stage_layers, L - lay.first_stage_layers - lay.last_stage_layers,
                   lay.first_stage_layers]
        lo = sum(swapped[:stage])
        return _stage(self, lo, lo + swapped[stage], stage)
