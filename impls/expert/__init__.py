"""The expert-parallel family: the experts of every MoE layer sharded over ep ranks, tokens
sent to them and back with all-to-alls (GShard, Lepikhin et al. 2020; Switch Transformer,
Fedus et al. 2021).

``dispatch`` is one MoE layer under expert parallelism (``moe_tokens``: route, dispatch
buffer, all-to-all, local experts, all-to-all back, combine; reused by the hybrid schemes);
``layer`` puts a rank's shard of the reference model together; ``scheme`` registers
``expert.alltoall`` (gradients: dense over dp, experts over edp); ``stats`` is what its row
reports. Closed forms: ``parbench.analytic.expert``; MoE semantics: ``parbench.model.moe``.
"""
