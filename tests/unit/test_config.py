"""Configuration: overrides, validation messages, Megatron and DeepSpeed imports."""
from __future__ import annotations

import json

import pytest

from parbench.config import CaseConfig, ConfigError, model_preset, validate_case
from parbench.import_deepspeed import from_deepspeed_json
from parbench.imports import from_megatron_args
from parbench.overrides import apply_overrides


def test_overrides_bare_and_dotted_keys():
    c = apply_overrides(CaseConfig(), {"model": "tiny-4l", "parallel.pp": "2", "dp": "3",
                                       "lr": "0.01", "sp": "true"})
    assert c.model.num_layers == 4 and c.layout.pp == 2 and c.layout.dp == 3
    assert c.run.lr == 0.01 and c.options.tensor.sp is True


@pytest.mark.parametrize("ov, msg", [
    ({"bogus": "1"}, "unknown key 'bogus'"),
    ({"parallel.nothing": "1"}, "parallel has no field 'nothing'"),
    ({"dp": "two"}, "dp='two' is not an integer"),
    ({"dp": "1.5"}, "dp='1.5' is not an integer"),
    ({"sp": "maybe"}, "sp='maybe' is not a boolean"),
    ({"model": "gpt5"}, "model='gpt5' is not a preset"),
])
def test_bad_overrides_name_the_field(ov, msg):
    with pytest.raises(ConfigError, match=msg.replace("(", "\\(").replace(".", "\\.")):
        apply_overrides(CaseConfig(), ov)


@pytest.mark.parametrize("ov, msg", [
    ({"tp": "3", "num_heads": "8", "hidden_size": "32"}, "tp=3 does not divide num_heads=8"),
    ({"num_heads": "5"}, "num_heads=5 does not divide hidden_size=32"),
    ({"pp": "3"}, "pp*vpp=3 does not divide num_layers=2"),
    ({"dp": "4", "ep": "3"}, "ep=3 does not divide cp*dp=4"),
    ({"zero_stage": "4"}, "zero_stage=4 must be one of 0, 1, 2, 3"),
    ({"steps": "0"}, "steps=0 must be >= 1"),
    ({"optimizer": "lamb"}, "optimizer='lamb' must be adamw or sgd"),
])
def test_rules(ov, msg):
    """A broken rule fails where the case is built or validated -- before any rank."""
    with pytest.raises(ConfigError) as e:
        validate_case(apply_overrides(CaseConfig(), ov))
    assert msg in str(e.value)


def test_world_size_must_match_degrees():
    c = apply_overrides(CaseConfig(), {"dp": "2", "pp": "2"})
    validate_case(c, 4)
    with pytest.raises(ConfigError, match="world_size=3 does not match tp\\*cp\\*dp\\*pp"):
        validate_case(c, 3)


def test_megatron_arguments():
    argv = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size=2",
            "--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "8",
            "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "16",
            "--num-layers-per-virtual-pipeline-stage", "2", "--sequence-parallel",
            "--context-parallel-size", "1", "--expert-model-parallel-size", "1",
            "--ffn-hidden-size", "256", "--clip-grad", "1.0"]
    c = from_megatron_args(argv, world_size=8)
    assert c.run.clip_grad == 1.0
    assert (c.layout.tp, c.layout.pp, c.layout.dp) == (2, 2, 2)
    assert c.layout.vpp == 2  # 8 layers / 2 stages / 2 layers per virtual stage
    assert c.layout.num_microbatches == 4  # 16 / (2 * 2)
    assert c.options.tensor.sp and c.model.ffn_hidden_size == 256 and c.model.num_heads == 8
    validate_case(c, 8)
    with pytest.raises(ConfigError, match="--global-batch-size=15: .* not a positive multiple"):
        from_megatron_args(["--micro-batch-size", "2", "--global-batch-size", "15"], 1)
    with pytest.raises(ConfigError, match="'--foo' is not supported"):
        from_megatron_args(["--foo", "1"])


def test_deepspeed_json():
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3,
           "train_batch_size": 24, "zero_optimization": {"stage": 2}, "bf16": {"enabled": True},
           "gradient_clipping": 0.5,
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.99],
                                                    "weight_decay": 0.1}}}
    c = from_deepspeed_json(json.dumps(cfg), world_size=4)
    assert (c.layout.micro_batch_size, c.layout.num_microbatches, c.layout.dp) == (2, 3, 4)
    assert c.options.data.zero_stage == 2 and c.run.dtype == "bf16"
    assert (c.run.lr, c.run.beta2, c.run.weight_decay) == (3e-4, 0.99, 0.1)
    assert c.run.clip_grad == 0.5
    cfg["train_batch_size"] = 25
    with pytest.raises(ConfigError, match="train_batch_size=25"):
        from_deepspeed_json(cfg, world_size=4)


def test_presets_validate():
    for name in ("tiny", "gpt3-175b", "ubmesh-moe-2t"):
        validate_case(CaseConfig(model=model_preset(name)))
    # LLaMA's SwiGLU / RMSNorm / GQA are for the estimate only: the reference model is GPT-2
    for name in ("llama2-7b", "llama2-70b"):
        with pytest.raises(ConfigError, match="analytic only"):
            validate_case(CaseConfig(model=model_preset(name)))
