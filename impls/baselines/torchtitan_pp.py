"""torchtitan 0.3.0's pipeline parallelism for ``baseline.torchtitan`` (pp > 1): its own
``pipeline_llm`` (``torchtitan.distributed.pipeline_parallel``) splits the Llama 3 model into
stages (``_generate_llm_fqn_per_model_part``, driven by its config: ``layers_per_stage`` =
num_layers / (pp * vpp), the embedding and head weighing no layer -- the stages parbench's
golden layout has, the embedding on the first, the norm and head on the last; one stage per
rank for GPipe and 1F1B, vpp for Interleaved1F1B), prunes each stage's
copy (``_pipeline_module_split``), applies ``parallelize_llama`` (TP + SP, FSDP2) to every
stage and builds the ``torch.distributed.pipelining`` schedule (``_build_pipeline_schedule``,
``scale_grads=False``) with torchtitan's ``CrossEntropyLoss`` (a token sum over the global
token count, as its trainer's ``pp_forward_backward_step`` passes ``global_valid_tokens``).

A step runs the schedule as that trainer method does, with one shim: torchtitan 0.3.0's
trainer calls ``step(arg_mbs=..., kwarg_mbs=..., target_mbs=...)``, an API the installed
torch (2.13) does not have (its ``step`` takes the whole batch and splits it), so the rank's
dp slice is passed whole with ``target``, ``losses`` and ``loss_kwargs``
(``global_valid_tokens``); the schedule cuts it into the case's micro-batches along dim 0
(micro-batch size = the case's, torchtitan's local batch = m of them).
"""
from __future__ import annotations

from parbench.config import CaseConfig, ConfigError

#: parbench schedule -> (torchtitan's ``pipeline_parallel_schedule``, looped: vpp stages a rank)
TITAN_SCHEDULES = {"gpipe": ("GPipe", 1), "1f1b": ("1F1B", 1),
                   "interleaved": ("Interleaved1F1B", 2)}


def check_titan_pp(case: CaseConfig) -> None:
    """Refuse a schedule torchtitan's pipeline path is not driven with here, or a stage count
    its schedule cannot hold (parbench's layout check has already asked pp*vpp | layers)."""
    lay = case.layout
    if lay.pp == 1:
        return
    if lay.schedule not in TITAN_SCHEDULES:
        raise ConfigError(f"schedule={lay.schedule!r}: baseline.torchtitan runs "
                          f"{', '.join(TITAN_SCHEDULES)} (torchtitan's GPipe, 1F1B, "
                          "Interleaved1F1B)")
    looped = TITAN_SCHEDULES[lay.schedule][1] > 1
    if looped != (lay.vpp > 1):
        raise ConfigError(f"vpp={lay.vpp}: torchtitan's {TITAN_SCHEDULES[lay.schedule][0]} "
                          f"holds {'two or more stages' if looped else 'one stage'} per rank")


def build_pipeline(scheme, model, tcfg):
    """torchtitan's ``pipeline_llm`` over ``model``: (schedule, model parts, has first stage,
    has last stage)."""
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed.pipeline_parallel import pipeline_llm
    from torchtitan.models.llama3.parallelize import parallelize_llama
    dims, lay = scheme.dims, scheme.ctx.layout
    par = ParallelismConfig(data_parallel_shard_degree=dims.dp_shard,
                            tensor_parallel_degree=dims.tp, context_parallel_degree=dims.cp,
                            pipeline_parallel_degree=dims.pp,
                            pipeline_parallel_schedule=TITAN_SCHEDULES[
                                lay.schedule][0],
                            pipeline_parallel_microbatch_size=lay.micro_batch_size,
                            pipeline_parallel_layers_per_stage=(
                                scheme.ctx.model.num_layers // (lay.pp * lay.vpp)),
                            pipeline_parallel_first_stage_less_layers=0,
                            pipeline_parallel_last_stage_less_layers=0,
                            spmd_backend="partial_dtensor")
    training = TrainingConfig(mixed_precision_param="float32",
                              local_batch_size=lay.micro_batch_size * lay.num_microbatches)
    return pipeline_llm(model, parallel_dims=dims, training=training, parallelism=par,
                        compile_config=CompileConfig(), ac_config=None, dump_folder="/tmp",
                        device=scheme.ctx.device, model_config=tcfg,
                        parallelize_fn=parallelize_llama,
                        loss_fn=CrossEntropyLoss(CrossEntropyLoss.Config()))


def pipeline_step(scheme, x, y, tokens: int, kwargs: dict) -> float:
    """One schedule step over this rank's batch ``x``, ``y`` (the schedule cuts it into the
    case's micro-batches along dim 0); this rank's summed loss (0 off the last stage)."""
    import torch
    first, last = scheme.pp_first, scheme.pp_last
    losses = [] if last else None
    scheme.schedule.step(*((x,) if first else ()), target=y if last else None,
                         losses=losses, loss_kwargs={"global_valid_tokens": tokens},
                         return_outputs=False, **kwargs)
    return float(torch.stack(losses).detach().sum()) if last else 0.0
