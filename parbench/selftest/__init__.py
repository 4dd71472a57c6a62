"""The mutation catalogue: realistic bugs in native schemes that the verdict must catch
(``catalogue``: the ``Mutant`` record and its decorator; ``mutants_*``: the bugs, one module
per family or scheme), and the small case each family's mutants run on.

``parbench selftest`` runs them (``parbench.mutation``): every mutant must be reported not
equivalent by a check (not by a crash or a refusal), and the unmodified schemes equivalent on
the same cases. A bug that cannot produce numbers (it crashes, or a validator refuses it) is
not a mutant; its numeric sibling is (see mutants_tutel, mutants_hybrid, mutants_wave).
"""
from __future__ import annotations

from .catalogue import CATALOGUE, Mutant, load, mutant

#: the case every mutant of a family runs on (before the mutant's own overrides)
FAMILY_CASES = {
    "data": {"model": "tiny", "dp": "2", "steps": "3", "timed_steps": "0",
             "micro_batch_size": "2", "bucket_mb": "0.01"},
    "pipeline": {"model": "tiny-4l", "pp": "2", "steps": "3", "timed_steps": "0",
                 "micro_batch_size": "1", "num_microbatches": "4"},
    "context": {"model": "tiny", "cp": "2", "steps": "3", "timed_steps": "0",
                "micro_batch_size": "2"},
    "tensor": {"model": "tiny", "tp": "2", "vocab_size": "61", "steps": "3",
               "timed_steps": "0", "micro_batch_size": "2", "num_microbatches": "2"},
    "expert": {"model": "tiny", "dp": "2", "ep": "2", "num_experts": "4", "steps": "3",
               "timed_steps": "0", "micro_batch_size": "2", "num_microbatches": "2"},
    "hybrid": {"model": "tiny", "tp": "2", "dp": "2", "ep": "2", "etp": "1",
               "num_experts": "4", "steps": "3", "timed_steps": "0",
               "micro_batch_size": "2", "num_microbatches": "2"},
}
#: the ``ci`` sample's fixed part (one per kind of check, a few per family);
#: ``parbench.mutation.ci_sample`` adds a mutant of every other scheme that has mutants
CI_SUBSET = ("ddp-no-wd", "ddp-no-divide", "zero3-double-wd", "zero1-no-allgather",
             "local-sgd-sum", "1f1b-no-wd", "1f1b-unscaled-loss", "zbh1-skip-w",
             "ring-no-rescale", "cp-pos-embed-local", "tp-fg-swapped",
             "tp-vocab-padding-unmasked", "sp-allreduce-for-reducescatter",
             "ddp-debug-allreduce", "zero3-keeps-gathered-units",
             "hybrid-moe-tokens-not-split", "ep-edp-mean", "ep-debug-alltoall",
             "zero1-bf16-no-wd", "zero2-bf16-one-grad-summed", "hybrid-bf16-sp-ln-not-reduced",
             "zero2-clip-local-norm", "tp-clip-replicated-counted-twice",
             "1f1b-clip-tied-counted-twice", "cp-clip-before-grad-allreduce",
             "ep-clip-expert-norm-local", "hybrid-clip-tp-duplicates",
             "ddp-loss-mean-per-microbatch", "ddp-packed-attention-crosses-docs",
             "ddp-gqa-kv-heads-tiled", "ring-zigzag-rope-contiguous",
             "tp-ce-masked-tokens-counted", "cp-loss-shard-token-mean",
             "ep-loss-mean-per-microbatch", "1f1b-loss-mean-per-microbatch",
             "interleaved-uneven-offset-one-rank-short")

__all__ = ["CATALOGUE", "CI_SUBSET", "FAMILY_CASES", "Mutant", "load", "mutant"]
