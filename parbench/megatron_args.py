"""What each Megatron-LM command-line argument does to a parbench case (data for
:mod:`parbench.imports`): the arguments that set fields, the flags, the choices, the ones the
checks read, the derived ones, those ignored (schedule, data, logging, performance) and those
refused (a computation parbench does not model), each table named by its role."""
from __future__ import annotations

#: Megatron arguments with one value that set a case field: name -> (bare field, type)
MEGATRON_ARGS = {
    "--tensor-model-parallel-size": ("tp", int), "--pipeline-model-parallel-size": ("pp", int),
    "--context-parallel-size": ("cp", int), "--expert-model-parallel-size": ("ep", int),
    "--expert-tensor-parallel-size": ("etp", int), "--micro-batch-size": ("micro_batch_size", int),
    "--num-layers": ("num_layers", int), "--hidden-size": ("hidden_size", int),
    "--num-attention-heads": ("num_heads", int), "--ffn-hidden-size": ("ffn_hidden_size", int),
    "--seq-length": ("seq_length", int), "--vocab-size": ("vocab_size", int),
    "--make-vocab-size-divisible-by": ("make_vocab_size_divisible_by", int),
    "--init-method-std": ("init_std", float), "--num-experts": ("num_experts", int),
    "--moe-router-topk": ("moe_top_k", int), "--moe-aux-loss-coeff": ("moe_aux_loss_coef", float),
    "--moe-z-loss-coeff": ("moe_z_loss_coef", float),
    "--moe-expert-capacity-factor": ("moe_capacity_factor", float),
    "--moe-ffn-hidden-size": ("moe_ffn_hidden_size", int),
    "--moe-shared-expert-intermediate-size": ("moe_shared_expert_size", int),
    "--clip-grad": ("clip_grad", float),
    "--lr": ("lr", float), "--weight-decay": ("weight_decay", float),
    "--adam-beta1": ("beta1", float), "--adam-beta2": ("beta2", float),
    "--adam-eps": ("eps", float), "--seed": ("seed", int),
    "--decoder-first-pipeline-num-layers": ("first_stage_layers", int),
    "--decoder-last-pipeline-num-layers": ("last_stage_layers", int),
    "--num-virtual-stages-per-pipeline-rank": ("vpp", int),
    "--kv-lora-rank": ("kv_lora_rank", int), "--q-lora-rank": ("q_lora_rank", int),
    "--qk-head-dim": ("qk_head_dim", int), "--qk-pos-emb-head-dim": ("qk_rope_head_dim", int),
    "--v-head-dim": ("v_head_dim", int),
    # group-limited routing (megatron/core/transformer/moe/moe_utils.py, group_limited_topk;
    # the checks in megatron_checks._router_groups)
    "--moe-router-group-topk": ("moe_router_topk_groups", int),
    # the routed gates times the factor after their normalisation (moe_utils.py,
    # topk_routing_with_score_function; DeepSeek-V3's 2.5): parbench.model.router
    "--moe-router-topk-scaling-factor": ("moe_router_scaling", float),
    # multi-token prediction modules (DeepSeek-V3 Sec. 2.2; counted by parbench.analytic)
    "--mtp-num-layers": ("mtp_layers", int),
}
#: Megatron arguments with a list of values that set a case field: name -> bare field (the
#: values joined by commas); ``--recompute-modules`` names what selective recomputation
#: recomputes (megatron/core/transformer/transformer_config.py ``recompute_modules``)
MEGATRON_LIST_ARGS = {"--recompute-modules": "recompute_modules"}
#: Megatron flags that set case fields: name -> {bare field: value}
MEGATRON_FLAGS = {
    # Megatron-Core's distributed optimizer shards the fp32 master weights and Adam's moments
    # over the data-parallel ranks (developer guide, "Distributed Optimizer": 6 + 12/d bytes
    # per parameter): ZeRO stage 1 (``analytic.memory``'s MEGATRON accounting); Megatron-FSDP's
    # ``--data-parallel-sharding-strategy`` sets the stage instead (MEGATRON_FSDP_STAGES)
    "--use-distributed-optimizer": {"zero_stage": 1},
    "--sequence-parallel": {"sp": True}, "--swiglu": {"mlp": "swiglu"},
    "--disable-bias-linear": {"bias": False}, "--bf16": {"dtype": "bf16"},
    # fp16 with loss scaling: estimate counts and prices it as the 2-byte type it is (A100 /
    # H100 tensor cores run fp16 at bf16's rate); `run` refuses it (fp32 or bf16)
    "--fp16": {"dtype": "fp16"},
    "--untie-embeddings-and-output-weights": {"tie_embeddings": False},
    "--use-rotary-position-embeddings": {"rope_theta": 10000.0, "position_embeddings": False},
    "--no-position-embedding": {"position_embeddings": False},
}
#: Megatron arguments whose value picks fields: name -> {value: {bare field: value}}
MEGATRON_CHOICES = {
    "--normalization": {"LayerNorm": {"norm": "layernorm"}, "RMSNorm": {"norm": "rmsnorm"}},
    "--position-embedding-type": {
        "learned_absolute": {"position_embeddings": True, "rope_theta": 0.0},
        "rope": {"position_embeddings": False, "rope_theta": 10000.0},
        "none": {"position_embeddings": False, "rope_theta": 0.0}},
    "--recompute-granularity": {"full": {"recompute": "full"},
                                "selective": {"recompute": "selective"}},
    # seq_aux_loss: the balancing loss per sequence (DeepSeek-V3 Eq. 17-20) instead of per
    # micro-batch; the same counts, FLOPs and bytes (Megatron-Core's router.py all-reduces
    # the E token counts over tp x cp for either), so estimate reads both alike
    "--moe-router-load-balancing-type": {"aux_loss": {}, "seq_aux_loss": {},
                                         "none": {"moe_aux_loss_coef": 0.0}},
    "--transformer-impl": {"local": {}, "transformer_engine": {}},
    # megatron/core/transformer/moe/moe_utils.py, topk_routing_with_score_function: softmax
    # over the experts or DeepSeek-V3's sigmoid affinities (sqrtsoftplus is not modelled)
    "--moe-router-score-function": {"softmax": {}, "sigmoid": {"moe_router": "sigmoid"}},
}
#: Megatron-FSDP (``--use-megatron-fsdp``): ``--data-parallel-sharding-strategy`` -> the ZeRO
#: stage it is (megatron/core/distributed/distributed_data_parallel_config.py: no_shard,
#: optim, optim_grads, optim_grads_params -- the optimizer states, then the gradients, then
#: the parameters sharded over the data-parallel ranks; its default no_shard)
MEGATRON_FSDP_STAGES = {"no_shard": 0, "optim": 1, "optim_grads": 2, "optim_grads_params": 3}
#: Megatron arguments read by the checks in :func:`_megatron_checks` (one value each)
MEGATRON_CHECKED = {"--num-query-groups": int, "--rotary-base": float, "--kv-channels": int,
                     "--max-position-embeddings": int, "--rotary-percent": float,
                     "--attention-dropout": float, "--hidden-dropout": float,
                     "--attention-backend": str, "--moe-layer-freq": str,
                     "--moe-router-num-groups": int, "--moe-router-bias-update-rate": float,
                     "--data-parallel-sharding-strategy": str,
                     "--megatron-fsdp-grad-comm-dtype": str,
                     "--megatron-fsdp-main-grads-dtype": str}
#: ``--attention-backend`` -> how ``estimate`` counts and prices attention: Megatron-Core's
#: ``auto`` (its default), ``flash`` and ``fused`` run a fused kernel that keeps no s x s
#: scores; ``unfused`` and ``local`` materialise them
MEGATRON_ATTENTION = {"auto": "flash", "flash": "flash", "fused": "flash", "unfused": "eager",
                      "local": "eager"}
#: flags read by the checks: GQA's and MLA's switches, and ``--qk-layernorm`` (under MLA the
#: latents' RMSNorms, which parbench counts; without MLA per-head query/key norms, refused)
#: and the router's: ``--moe-router-enable-expert-bias`` (with ``--moe-router-bias-update-rate``,
#: :data:`MEGATRON_BIAS_UPDATE_RATE` when absent) and ``--moe-router-pre-softmax``
MEGATRON_CHECKED_FLAGS = frozenset({"--use-megatron-fsdp",
                                    "--group-query-attention", "--multi-latent-attention",
                                    "--qk-layernorm", "--moe-router-enable-expert-bias",
                                    "--moe-router-pre-softmax"})
#: Megatron-Core's default ``moe_router_bias_update_rate`` (megatron/core/transformer/
#: transformer_config.py: "The default value 1e-3 is same as that used in DeepSeekV3")
MEGATRON_BIAS_UPDATE_RATE = 1e-3
#: Megatron-Core's MoE defaults where parbench's differ, taken when an MoE model
#: (``--num-experts``) leaves them out: top-2 (transformer_config.py ``moe_router_topk``), no
#: auxiliary loss (arguments.py ``--moe-aux-loss-coeff`` 0.0), no capacity limit
#: (``--moe-expert-capacity-factor`` None: no token dropped)
MEGATRON_MOE_DEFAULTS = {"moe_top_k": 2, "moe_aux_loss_coef": 0.0, "moe_capacity_factor": 0.0}
#: Megatron arguments that derive a layout field from the others
MEGATRON_DERIVED = {"--global-batch-size": "num_microbatches",
                     "--num-layers-per-virtual-pipeline-stage": "vpp"}
#: Megatron flags that do not change what parbench computes (performance, logging, checkpoints)
MEGATRON_IGNORED_FLAGS = frozenset("--" + n for n in """
use-flash-attn use-mcore-models overlap-grad-reduce overlap-param-gather
cross-entropy-loss-fusion manual-gc no-masked-softmax-fusion
no-bias-gelu-fusion no-bias-swiglu-fusion no-bias-dropout-fusion no-rope-fusion
no-gradient-accumulation-fusion log-throughput log-params-norm log-num-zeros-in-grad
log-timers-to-tensorboard log-validation-ppl-to-tensorboard log-memory-to-tensorboard
log-progress tp-comm-overlap moe-grouped-gemm moe-permute-fusion mock-data
no-create-attention-mask-in-dataloader no-async-tensor-model-parallel-allreduce
no-load-optim no-load-rng no-save-optim no-save-rng exit-on-missing-checkpoint
use-checkpoint-args accumulate-allreduce-grads-in-fp32 attention-softmax-in-fp32
distribute-saved-activations use-torch-fsdp2 ddp-average-in-collective
align-grad-reduce align-param-gather defer-embedding-wgrad-compute
no-check-for-nan-in-loss-and-grad no-mmap-bin-files auto-detect-ckpt-format
moe-shared-expert-overlap moe-router-fusion init-model-with-meta-device fsdp-double-buffer
use-nccl-ub enable-experimental""".split())
#: Megatron arguments with values that do not change what parbench computes (schedule, data,
#: logging, checkpoints, performance); their values are skipped up to the next ``--``
MEGATRON_IGNORED_VALUED = frozenset("--" + n for n in """
lr-decay-style lr-warmup-iters lr-warmup-fraction lr-warmup-samples lr-decay-iters
lr-decay-samples lr-warmup-init min-lr train-iters train-samples data-path train-data-path
valid-data-path test-data-path split tokenizer-type tokenizer-model vocab-file merge-file
data-cache-path log-interval save load save-interval eval-interval eval-iters
tensorboard-dir tensorboard-queue-size wandb-project wandb-exp-name wandb-save-dir
num-workers distributed-backend distributed-timeout-minutes
manual-gc-interval ckpt-format moe-token-dispatcher-type exit-duration-in-mins
exit-interval log-interval timing-log-level bucket-size ddp-bucket-size
moe-router-dtype optimizer dist-ckpt-strictness logging-level moe-flex-dispatcher-backend
norm-epsilon""".split())
#: Megatron arguments that change the numbers a model computes but none of the figures
#: ``estimate`` prints (no parameter, FLOP, byte or time), accepted and listed as ignored:
#: name -> what it changes (with one value each, or none for a flag)
MEGATRON_NUMERICS_ONLY = {
    "--rotary-scaling-factor": "YaRN's RoPE frequency interpolation (Peng et al. 2023)",
    "--mscale": "YaRN's attention-temperature factor",
    "--mscale-all-dim": "YaRN's attention-temperature factor",
    "--mtp-loss-scaling-factor": "the weight of the MTP loss (DeepSeek-V3 Eq. 25, lambda)",
}
#: flags of the same kind: uniform routing forced (a benchmark mode) -- estimate prices
#: balanced routing either way
MEGATRON_NUMERICS_ONLY_FLAGS = {"--moe-router-force-load-balancing": "routing forced uniform",
                                "--calculate-per-token-loss": "the loss summed per token and "
                                "divided by the global batch's token count"}
#: Megatron arguments that change the computation in ways parbench does not model
MEGATRON_REFUSED = {
    "--account-for-embedding-in-pipeline-split": "the embedding counted as a pipeline layer "
    "is not modelled (give --decoder-first-pipeline-num-layers instead)",
    "--account-for-loss-in-pipeline-split": "the loss counted as a pipeline layer is not "
    "modelled (give --decoder-last-pipeline-num-layers instead)",
    "--apply-layernorm-1p": "the zero-centred (1 + gamma) norm is not modelled",
    "--fp8-format": "fp8 is not modelled", "--fp8-recipe": "fp8 is not modelled",
    "--rampup-batch-size": "a batch size that changes during training is not modelled",
    "--step-batch-size-schedule": "a batch size that changes during training is not modelled",
    "--recompute-method": "recomputing some layers only is not modelled (every layer at the "
    "granularity and modules given)",
    "--recompute-num-layers": "recomputing some layers only is not modelled (every layer at "
    "the granularity and modules given)",
}
#: Megatron arguments that must keep one value (the one parbench computes with): name -> value
MEGATRON_FIXED = {"--rotary-percent": 1.0, "--attention-dropout": 0.0, "--hidden-dropout": 0.0}
