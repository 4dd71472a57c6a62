"""``megatron_args=``: the argument lists of Megatron-LM's example scripts import (issue 21).

The lists are written out here after Megatron-LM's examples (GPT-3 175B, LLaMA-3 8B / 70B,
Mixtral 8x7B): model, layout, optimizer, data, logging and checkpoint arguments together."""
from __future__ import annotations

import json
import shlex

import pytest

from parbench.cli import main
from parbench.config import ConfigError
from parbench.imports import from_megatron_args, megatron_ignored, megatron_overrides

GPT3_175B = """
--tensor-model-parallel-size 8 --pipeline-model-parallel-size 16 --num-layers 96
--hidden-size 12288 --num-attention-heads 96 --seq-length 2048 --max-position-embeddings 2048
--attention-backend auto --micro-batch-size 1 --global-batch-size 1536
--train-iters 500000 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95
--init-method-std 0.006 --clip-grad 1.0 --bf16 --lr 6.0e-5 --lr-decay-style cosine
--min-lr 6.0e-6 --lr-warmup-fraction .001 --lr-decay-iters 430000
--use-mcore-models --data-path /data/my-gpt3_00_text_document --vocab-file vocab.json
--merge-file merges.txt --split 949,50,1 --log-interval 100 --save-interval 10000
--eval-interval 1000 --save /ckpt --load /ckpt --eval-iters 10 --tensorboard-dir /tb
"""

LLAMA3_8B = """
--use-mcore-models --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336
--num-attention-heads 32 --group-query-attention --num-query-groups 8 --kv-channels 128
--seq-length 8192 --max-position-embeddings 8192 --position-embedding-type rope
--rotary-base 500000 --rotary-percent 1.0 --attention-dropout 0.0 --hidden-dropout 0.0
--swiglu --init-method-std 0.0134 --attention-backend fused --normalization RMSNorm
--disable-bias-linear --untie-embeddings-and-output-weights
--micro-batch-size 1 --global-batch-size 128 --train-samples 1953125000
--lr-decay-samples 1949218748 --lr-warmup-samples 3906252 --lr 0.00015 --min-lr 0.00001
--lr-decay-style cosine --clip-grad 1.0 --weight-decay 0.1 --adam-beta1 0.9
--adam-beta2 0.95 --bf16 --cross-entropy-loss-fusion --manual-gc
--tensor-model-parallel-size 1 --context-parallel-size 2 --sequence-parallel
--pipeline-model-parallel-size 1 --use-distributed-optimizer --overlap-grad-reduce
--overlap-param-gather --tokenizer-type HuggingFaceTokenizer
--tokenizer-model meta-llama/Meta-Llama-3-8B
--mock-data --log-interval 1 --eval-iters 32 --eval-interval 100 --save-interval 1000
--log-throughput --distributed-timeout-minutes 60 --vocab-size 128256
"""

LLAMA3_70B = """
--num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672 --num-attention-heads 64
--group-query-attention --num-query-groups 8 --kv-channels 128 --seq-length 8192
--max-position-embeddings 8192 --position-embedding-type rope --rotary-base 500000
--normalization RMSNorm --swiglu --disable-bias-linear --untie-embeddings-and-output-weights
--tensor-model-parallel-size 8 --pipeline-model-parallel-size 4 --sequence-parallel
--num-layers-per-virtual-pipeline-stage 5 --micro-batch-size 1 --global-batch-size 128
--recompute-granularity selective --bf16 --use-distributed-optimizer --use-flash-attn
--tokenizer-type HuggingFaceTokenizer --tokenizer-model meta-llama/Meta-Llama-3-70B
--data-path 0.5 /data/a_text_document 0.5 /data/b_text_document --split 99,1,0
"""

MIXTRAL_8X7B = """
--use-mcore-models --disable-bias-linear --seq-length 4096 --max-position-embeddings 32768
--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
--init-method-std 0.01 --attention-dropout 0.0 --hidden-dropout 0.0 --normalization RMSNorm
--position-embedding-type rope --swiglu --untie-embeddings-and-output-weights
--group-query-attention --num-query-groups 8 --no-masked-softmax-fusion
--no-position-embedding --rotary-base 1000000
--num-experts 8 --moe-router-load-balancing-type aux_loss --moe-router-topk 2
--moe-aux-loss-coeff 1e-2 --moe-grouped-gemm --moe-token-dispatcher-type alltoall
--micro-batch-size 1 --global-batch-size 256 --lr 1e-4 --train-iters 500000
--lr-decay-iters 320000 --lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 0.1
--lr-warmup-iters 500 --clip-grad 1.0 --bf16
--tensor-model-parallel-size 1 --pipeline-model-parallel-size 4 --expert-model-parallel-size 8
--use-distributed-optimizer --sequence-parallel --tokenizer-type Llama2Tokenizer
--tokenizer-model tokenizer.model --data-path /data/mixtral_text_document --split 99990,8,2
--log-interval 1 --save-interval 10000 --eval-interval 1000 --eval-iters 10
--save /ckpt --load /ckpt --tensorboard-dir /tb --no-load-optim --no-load-rng
"""


def _case(text, world=None):
    return from_megatron_args(shlex.split(text), world)


def test_gpt3_175b():
    c = _case(GPT3_175B, world=1536)
    m = c.model
    assert (m.num_layers, m.hidden_size, m.num_heads, m.seq_length) == (96, 12288, 96, 2048)
    assert (m.mlp, m.norm, m.bias, m.rope_theta, m.position_embeddings) == \
        ("gelu", "layernorm", True, 0.0, True)
    assert m.tie_embeddings and m.init_std == 0.006
    assert (c.layout.tp, c.layout.pp, c.layout.dp) == (8, 16, 12)
    assert c.layout.num_microbatches == 128  # 1536 / (1 * 12)
    r = c.run
    assert (r.lr, r.weight_decay, r.beta1, r.beta2, r.clip_grad, r.dtype) == \
        (6.0e-5, 0.1, 0.9, 0.95, 1.0, "bf16")
    assert "--lr-decay-style" in megatron_ignored(shlex.split(GPT3_175B))


def test_llama3_8b():
    c = _case(LLAMA3_8B)
    m = c.model
    assert (m.num_kv_heads, m.mlp, m.norm, m.bias, m.rope_theta) == \
        (8, "swiglu", "rmsnorm", False, 500000.0)
    assert not m.position_embeddings and not m.tie_embeddings and m.init_std == 0.0134
    assert (m.ffn_hidden_size, m.vocab_size) == (14336, 128256)
    assert (c.layout.cp, c.options.tensor.sp, c.run.lr) == (2, True, 0.00015)
    ign = megatron_ignored(shlex.split(LLAMA3_8B))
    assert {"--use-mcore-models", "--mock-data", "--tokenizer-model",
            "--overlap-grad-reduce"} <= set(ign)
    assert "--attention-backend" not in ign  # read: how estimate counts attention


def test_llama3_70b():
    c = _case(LLAMA3_70B, world=64)
    m = c.model
    assert (m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads) == (80, 8192, 64, 8)
    assert (c.layout.tp, c.layout.pp, c.layout.dp, c.layout.vpp) == (8, 4, 2, 4)
    assert c.options.recompute == "selective" and c.run.dtype == "bf16"
    assert "--data-path" in megatron_ignored(shlex.split(LLAMA3_70B))  # 4 values skipped


def test_mixtral_8x7b():
    c = _case(MIXTRAL_8X7B, world=64)
    m = c.model
    assert (m.num_experts, m.moe_top_k, m.moe_aux_loss_coef) == (8, 2, 0.01)
    assert (m.num_kv_heads, m.rope_theta, m.position_embeddings) == (8, 1e6, False)
    assert (c.layout.ep, c.layout.pp, c.layout.dp) == (8, 4, 16)
    over = megatron_overrides(MIXTRAL_8X7B.replace("--expert-model-parallel-size 8", ""))
    assert over["model.num_experts"] == "8" and over["run.dtype"] == "bf16"


def test_llama3_8b_parameters_on_the_command_line(capsys):
    assert main(["estimate", "megatron_args=" + " ".join(LLAMA3_8B.split()), "--json"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["parameters"]["total"] == 8_030_261_248
    line, = [ln for ln in out.err.splitlines() if ln.startswith("ignored Megatron")]
    assert "--use-flash-attn" not in line and "--mock-data" in line


@pytest.mark.parametrize("text, match", [
    ("--num-layers 2 --frobnicate 3", r"'--frobnicate' is not supported \(unknown"),
    ("--account-for-embedding-in-pipeline-split", "--account-for-embedding-in-pipeline-split "
                                                  "is not supported: the embedding counted"),
    ("--multi-latent-attention", "--multi-latent-attention needs --kv-lora-rank"),
    ("--kv-lora-rank 512", "--kv-lora-rank without --multi-latent-attention"),
    ("--fp8-format hybrid", "fp8 is not modelled"),
    ("--apply-layernorm-1p", "--apply-layernorm-1p is not supported"),
    ("--qk-layernorm", "--qk-layernorm is not supported: query/key norms"),
    ("--multi-latent-attention --kv-lora-rank 512", "without --qk-layernorm is not supported"),
    ("--attention-dropout 0.1", r"--attention-dropout=0.1 is not supported: parbench computes"),
    ("--rotary-percent 0.5", "--rotary-percent=0.5"),
    ("--hidden-size 64 --num-attention-heads 4 --kv-channels 8", "ties head_dim"),
    ("--seq-length 64 --max-position-embeddings 32", "below --seq-length=64"),
    ("--normalization Foo", "--normalization=Foo is not supported"),
    ("--num-layers", "needs a value"),
    ("--attention-backend magic", "--attention-backend=magic is not supported"),
    ("--step-batch-size-schedule '0:16 2.4B:320'", "--step-batch-size-schedule is not "
                                                    "supported: a batch size that changes"),
])
def test_refused_and_unknown_arguments_one_clear_line(text, match):
    with pytest.raises(ConfigError, match=match) as e:
        _case(text)
    assert "\n" not in str(e.value)


def test_flags_and_values_parse_apart():
    argv = shlex.split("--use-flash-attn --num-layers 4 --data-path 1 a 2 b --hidden-size 64 "
                       "--log-interval=5 --manual-gc --num-attention-heads 4")
    c = from_megatron_args(argv)
    assert (c.model.num_layers, c.model.hidden_size, c.model.num_heads) == (4, 64, 4)
    assert megatron_ignored(argv) == ["--use-flash-attn", "--data-path", "--log-interval",
                                      "--manual-gc"]


#: NVIDIA/Megatron-LM examples/mixtral/train_mixtral_8x7b_distributed.sh, its argument arrays
#: in order as the script passes them (paths and the tokenizer model replaced), unmodified
MIXTRAL_SCRIPT = """
--use-mcore-models --disable-bias-linear --seq-length 4096 --max-position-embeddings 32768
--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
--init-method-std 0.01 --attention-dropout 0.0 --hidden-dropout 0.0 --normalization RMSNorm
--position-embedding-type rope --swiglu --untie-embeddings-and-output-weights
--group-query-attention --num-query-groups 8 --no-masked-softmax-fusion
--no-position-embedding --rotary-base 1000000
--num-experts 8 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss
--moe-aux-loss-coeff 1e-2 --moe-grouped-gemm --moe-token-dispatcher-type alltoall
--overlap-param-gather --overlap-grad-reduce
--tokenizer-type Llama2Tokenizer --tokenizer-model /tok --data-path /data --split 99990,8,2
--micro-batch-size 1 --global-batch-size 256 --lr 1e-4 --train-iters 500000
--lr-decay-iters 320000 --lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 0.1
--lr-warmup-iters 500 --clip-grad 1.0 --bf16
--tensor-model-parallel-size 1 --pipeline-model-parallel-size 4
--expert-model-parallel-size 8 --use-distributed-optimizer --sequence-parallel
--log-interval 1 --save-interval 10000 --eval-interval 1000 --eval-iters 10 --save /ck
--load /ck --tensorboard-dir /ck/tensorboard --no-load-optim --no-load-rng
"""


def test_megatron_lms_own_mixtral_script_estimates_with_its_default_flash_attention(capsys):
    """The official script, not a list written after it: it imports as it is, and with no
    --attention-backend Megatron-Core runs its fused kernel (``auto``), so estimate counts
    flash attention -- eager scores of 32 heads x 4096^2 would not fit an 80 GB device."""
    args = ["estimate", "megatron_args=" + " ".join(MIXTRAL_SCRIPT.split()),
            "device=a100-80gb", "--json"]
    assert main(args) == 0
    flash = json.loads(capsys.readouterr().out)
    assert main(args + ["attention=eager"]) == 0
    eager = json.loads(capsys.readouterr().out)
    assert flash["memory"]["activations"]["attention"] == "flash"
    assert eager["memory"]["activations"]["attention"] == "eager"
    # the script's layout (ep 8, pp 4 on 64 GPUs) fits with the fused kernel only
    assert flash["time"]["fits"] and not eager["time"]["fits"]


def test_fp16_is_estimated_as_two_bytes_and_refused_by_run(capsys):
    """``--fp16`` sets estimate's dtype (2-byte activations and messages, fp16 tensor-core
    rate); ``run`` names the dtype it refuses."""
    args = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --fp16"
    assert main(["estimate", f"megatron_args={args}", "--json"]) == 0
    est = json.loads(capsys.readouterr().out)
    assert est["inputs"]["bytes_per_element"] == 2
    case = from_megatron_args(shlex.split(args))
    assert case.run.dtype == "fp16"
    from parbench.config import validate_case
    with pytest.raises(ConfigError, match="dtype='fp16' must be fp32 or bf16"):
        validate_case(case)


#: the model, routing and precision arguments Megatron-LM's DeepSeek-V3 example passes
#: (examples/megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh), written out; each feature parbench
#: does not model must be refused by name, the rest must import
DEEPSEEK_V3_REFUSED = {
    "--recompute-granularity selective --recompute-num-layers 2": "some layers only",
}
#: the same script's recomputation and layout (TP=1, EP=8, MBS=4 by default)
DEEPSEEK_V3_RECOMPUTE = """
--recompute-granularity selective --recompute-modules mlp moe mla_up_proj layernorm
--tensor-model-parallel-size 1 --expert-model-parallel-size 8
--expert-tensor-parallel-size 1 --micro-batch-size 4 --sequence-parallel
"""
#: the same script's routing arguments parbench applies (and --moe-shared-expert-overlap of
#: examples/post_training/modelopt/conf/deepseek-ai/DeepSeek-R1.sh), in the order given
DEEPSEEK_V3_ROUTER = """
--moe-router-pre-softmax --moe-aux-loss-coeff 1e-4 --moe-router-group-topk 4
--moe-router-num-groups 8 --moe-router-score-function sigmoid --moe-router-enable-expert-bias
--moe-router-bias-update-rate 1e-3 --moe-router-dtype fp32 --moe-permute-fusion
--moe-shared-expert-overlap --moe-router-topk-scaling-factor 2.5
"""
DEEPSEEK_V3_MODEL = """
--num-layers 61 --hidden-size 7168 --ffn-hidden-size 18432 --num-attention-heads 128
--kv-channels 128 --max-position-embeddings 4096 --seq-length 4096
--position-embedding-type rope --rotary-base 10000 --make-vocab-size-divisible-by 3232
--normalization RMSNorm --norm-epsilon 1e-6 --swiglu --untie-embeddings-and-output-weights
--multi-latent-attention --attention-dropout 0.0 --hidden-dropout 0.0 --qk-layernorm
--num-experts 256 --moe-layer-freq [0]*3+[1]*58 --moe-ffn-hidden-size 2048
--moe-shared-expert-intermediate-size 2048 --moe-router-topk 8 --moe-aux-loss-coeff 1e-4
--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend hybridep --moe-grouped-gemm
--q-lora-rank 1536 --kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim 64
--v-head-dim 128 --disable-bias-linear --bf16 --vocab-size 129280
"""


@pytest.mark.parametrize("extra, match", DEEPSEEK_V3_REFUSED.items())
def test_megatron_lms_deepseek_v3_example_refuses_what_is_not_modelled(extra, match):
    with pytest.raises(ConfigError, match=match):
        from_megatron_args(shlex.split(DEEPSEEK_V3_MODEL + extra))


def test_megatron_lms_deepseek_v3_example_recompute_modules_import_and_are_counted():
    """``--recompute-modules mlp moe mla_up_proj layernorm`` sets recompute_modules (in
    Megatron-Core's order of names); estimate then keeps, per dense layer, neither the norms'
    outputs nor MLA's up-projected Q/K/V nor the MLP's internals, per MoE layer no routed
    tensor, and counts the MoE layer's dispatch and combine again (6 all-to-alls per MoE layer
    and micro-batch, as under full recomputation): each figure against the same layout with
    core_attn alone, from the closed forms' own terms."""
    from parbench.analytic import Counting, estimate
    from parbench.analytic.shape import shape_from
    from parbench.imports import megatron_attention
    argv = shlex.split(DEEPSEEK_V3_MODEL + DEEPSEEK_V3_RECOMPUTE)
    case = from_megatron_args(argv)
    opt = case.options
    assert (opt.recompute, opt.recompute_modules) == ("selective", "layernorm,mla_up_proj,mlp,moe")
    shape = shape_from(case.model)
    counting = Counting(attention=megatron_attention(argv))  # auto: a fused kernel
    assert counting.attention == "flash"
    mods = estimate(shape, case.layout, opt, counting)
    core = estimate(shape, case.layout, opt.with_values(recompute_modules="core_attn"), counting)
    act, act0 = mods.memory.activations, core.memory.activations
    s, b, h, e, f = 4096, 4, 7168, 2, 18432
    qkv = 128 * 192 + 128 * 192 + 128 * 128
    flash_out = s * b * 128 * 128 * e + 128 * s * b * 4  # the core's output and its LSE
    saved = 2 * s * b * h * e + qkv * s * b * e + 3 * s * b * f * e - flash_out
    assert act0.per_layer_korthikanti - act.per_layer_korthikanti == saved
    terms = act.moe_layer_terms_korthikanti
    assert all(terms[k] == 0 for k in ("router", "dispatch", "expert_mlp", "combine",
                                       "shared_mlp", "dense_mlp_replaced"))
    assert mods.communication.expert.all_to_alls_per_moe_layer_per_micro_batch == 6
    assert core.communication.expert.all_to_alls_per_moe_layer_per_micro_batch == 4


def test_megatron_lms_deepseek_v3_example_model_imports_with_its_published_count():
    from parbench.analytic.params import total_params
    from parbench.analytic.shape import shape_from
    case = from_megatron_args(shlex.split(DEEPSEEK_V3_MODEL))
    shape = shape_from(case.model)
    assert total_params(shape) == 671_026_404_352
    assert shape.moe_first_dense == 3 and shape.q_lora_rank == 1536


def test_megatron_lms_deepseek_v3_example_routing_applies_the_deepseek_v3_router():
    """Megatron-Core's semantics (megatron/core/transformer/moe/moe_utils.py,
    topk_routing_with_score_function): sigmoid scores, the expert bias at gamma 1e-3, 4 of 8
    groups, top-8; --moe-router-pre-softmax is read by the softmax branch only, so with the
    sigmoid score it changes nothing and is listed as ignored with the performance flags."""
    argv = shlex.split(DEEPSEEK_V3_MODEL + DEEPSEEK_V3_ROUTER)
    m = from_megatron_args(argv).model
    assert (m.moe_router, m.moe_bias_update_rate, m.moe_top_k) == ("sigmoid", 1e-3, 8)
    assert (m.moe_router_groups, m.moe_router_topk_groups) == (8, 4)
    assert (m.moe_first_dense, m.moe_every, m.moe_aux_loss_coef) == (3, 1, 1e-4)
    assert m.moe_router_scaling == 2.5
    ignored = megatron_ignored(argv)
    for name in ("--moe-router-pre-softmax", "--moe-router-dtype", "--moe-permute-fusion",
                 "--moe-shared-expert-overlap", "--moe-grouped-gemm", "--norm-epsilon"):
        assert name in ignored
    for name in ("--moe-router-score-function", "--moe-router-enable-expert-bias",
                 "--moe-router-group-topk", "--moe-router-num-groups",
                 "--moe-router-bias-update-rate", "--moe-router-topk-scaling-factor"):
        assert name not in ignored


def test_the_distributed_optimizer_and_megatron_fsdp_set_the_zero_stage():
    """Megatron-Core's distributed optimizer shards the optimizer states over dp (6 + 12/d
    bytes per parameter): ZeRO-1. Megatron-FSDP's sharding strategy is the stage (optim 1,
    optim_grads 2, optim_grads_params 3, no_shard 0) whatever the flags' order; without
    --use-megatron-fsdp the strategy changes nothing and is listed so; a gradient dtype other
    than the run's is refused by name."""
    from parbench.imports import megatron_ignored
    base = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --bf16 "
    assert from_megatron_args(shlex.split(base)).options.data.zero_stage == 0
    dist = base + "--use-distributed-optimizer"
    assert from_megatron_args(shlex.split(dist)).options.data.zero_stage == 1
    for strategy, stage in (("optim", 1), ("optim_grads", 2), ("optim_grads_params", 3),
                            ("no_shard", 0)):
        argv = shlex.split(f"{base}--use-megatron-fsdp --data-parallel-sharding-strategy "
                           f"{strategy} --use-distributed-optimizer "
                           "--megatron-fsdp-main-grads-dtype bf16")
        assert from_megatron_args(argv).options.data.zero_stage == stage
    alone = shlex.split(dist + " --data-parallel-sharding-strategy optim_grads_params")
    assert from_megatron_args(alone).options.data.zero_stage == 1
    assert "--data-parallel-sharding-strategy" in megatron_ignored(alone)
    with pytest.raises(ConfigError, match="--megatron-fsdp-main-grads-dtype=fp32 is not "
                                          "supported"):
        from_megatron_args(shlex.split(base + "--use-megatron-fsdp "
                                       "--megatron-fsdp-main-grads-dtype fp32"))
