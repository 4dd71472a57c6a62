"""``baseline.megatron.ptdp`` with Megatron-Core's tensor-parallel attributes set on its
sharded weights, as Megatron sets them when it initialises the weights itself
(``perform_initialization=True``: ``_initialize_affine_weight_cpu`` /
``_initialize_affine_weight_gpu`` call ``set_tensor_model_parallel_attributes``). The stock
baseline loads the reference weights with ``perform_initialization=False`` (as a checkpoint
or converted weights are loaded), where Megatron-Core 0.16 leaves the weights of
``ColumnParallelLinear``, ``RowParallelLinear`` and ``VocabParallelEmbedding`` unmarked; its
gradient norm then counts them on tp rank 0 only (``param_is_not_tensor_parallel_duplicate``).
Loaded by file (``FILE:Class``) in tests/baselines/test_megatron_ptdp.py to show the
diagnosis: marked, the same case clips as the golden run."""
from __future__ import annotations

from impls.baselines.megatron_ptdp import MegatronCorePTDP


class MarkedPTDP(MegatronCorePTDP):
    def __init__(self, ctx):
        super().__init__(ctx)
        from megatron.core.tensor_parallel import (ColumnParallelLinear, RowParallelLinear,
                                                   VocabParallelEmbedding)
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
        for m in self.model.modules():
            if isinstance(m, (ColumnParallelLinear, VocabParallelEmbedding)) \
                    and m.weight is not None:
                set_tensor_model_parallel_attributes(m.weight, True, 0, 1)
            elif isinstance(m, RowParallelLinear):
                set_tensor_model_parallel_attributes(m.weight, True, 1, 1)
