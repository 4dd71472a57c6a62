"""The DeepSpeed engine the MoE and Ulysses baselines train with: ZeRO stage 0, fp32, no
gradient clipping, the client optimizer of the run (``make_optimizer``: ``AdamW(foreach=False)``,
so no fused Adam is compiled), ``gradient_accumulation_steps = m`` (``engine.backward``
scales each micro-batch loss by 1/m) and parbench's mesh answering DeepSpeed's process-group
questions (``mpu``)."""
from __future__ import annotations

from parbench.model import make_optimizer

from impls.baselines.deepspeed_zero import _quiet


def stage0_engine(ds, module, ctx, mpu):
    """``deepspeed.initialize`` (module ``ds``) of ``module`` for the case of ``ctx``, torch
    distributed already up; returns the engine."""
    p = ctx.layout
    config = {"train_micro_batch_size_per_gpu": p.micro_batch_size,
              "gradient_accumulation_steps": p.num_microbatches,
              "train_batch_size": p.micro_batch_size * p.num_microbatches * p.dp,
              "zero_optimization": {"stage": 0}, "gradient_clipping": 0.0,
              "steps_per_print": 2**31 - 1, "wall_clock_breakdown": False}
    with _quiet():
        engine, _, _, _ = ds.initialize(
            model=module, optimizer=make_optimizer(module.parameters(), ctx.run),
            config=config, mpu=mpu, dist_init_required=False)
    return engine
