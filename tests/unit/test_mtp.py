"""Multi-token prediction, analytic only (issue 21: DeepSeek-V3 Sec. 2.2; Megatron-LM's
``--mtp-num-layers``): the modules' parameters against DeepSeek-V3's published checkpoint
layout, their FLOPs against Megatron-LM's accounting, the import of the DeepSeek-V3 example's
MTP, YaRN and sequence-wise balancing arguments, and ``run`` refusing them."""
from __future__ import annotations

import json
import shlex

import pytest

from parbench.analytic.flops import shape_training_flops
from parbench.analytic.params import layer_params, mtp_params, stage_params, total_params
from parbench.analytic.shape import shape_from
from parbench.cli import main
from parbench.config import ConfigError, ModelConfig, validate_runnable_model
from parbench.imports import from_megatron_args, megatron_ignored
from parbench.presets import PRESETS
from tests.unit.test_megatron_import import DEEPSEEK_V3_MODEL

#: DeepSeek-V3's published main-model count (arXiv 2412.19437, Table 1 / Sec. 4.2: 671B)
DEEPSEEK_V3_MAIN = 671_026_404_352
#: the arguments of Megatron-LM's DeepSeek-V3 example (examples/megatron_fsdp/
#: sbatch_mfsdp_deepseek_v3.sh) that parbench refused before: YaRN, MTP, seq_aux_loss,
#: forced balancing
DEEPSEEK_V3_MTP_YARN = """
--moe-router-load-balancing-type seq_aux_loss --moe-router-force-load-balancing
--rotary-scaling-factor 40 --mscale 1.0 --mscale-all-dim 1.0 --mtp-num-layers 1
--mtp-loss-scaling-factor 0.1
"""


def _v3(**kw):
    return shape_from(ModelConfig(**{**PRESETS["deepseek-v3"], **kw}))


def test_mtp_module_matches_the_published_checkpoint_layout():
    """DeepSeek-V3's released checkpoint holds its one MTP module as layer 61: enorm and hnorm
    [7168], eh_proj [7168, 14336], shared_head.norm [7168], and a transformer layer like layer
    60 (an MoE layer); its embed_tokens and shared_head.head are copies of the main model's,
    shared in training (Sec. 2.2) and not counted again."""
    s = _v3(mtp_layers=1)
    layer60 = layer_params(_v3(), moe_layer=True)
    assert mtp_params(s) == layer60 + 3 * 7168 + 7168 * 14336
    assert total_params(s) - mtp_params(s) == DEEPSEEK_V3_MAIN
    # "685B = 671B main + 14B MTP" (the model card; both rounded): the checkpoint also stores
    # the module's copies of the embedding and head; within 0.1% (the card rounds to 1B, and
    # its count includes the FP8 weights' block scales, which are not parameters)
    copies = 2 * 129280 * 7168
    assert abs(total_params(s) + copies - 685e9) / 685e9 < 1e-3
    # the module with its copies: 13.46e9 against the card's "14B" (rounded to 1B)
    assert abs(mtp_params(s) + copies - 14e9) < 0.6e9


def test_mtp_sits_on_the_last_pipeline_stage():
    s = _v3(mtp_layers=2, num_layers=60)
    with_mtp, without = stage_params(s, pp=4), stage_params(_v3(num_layers=60), pp=4)
    assert [a["total"] for a in with_mtp[:3]] == [b["total"] for b in without[:3]]
    assert with_mtp[3]["total"] - without[3]["total"] == mtp_params(s)


@pytest.mark.parametrize("recompute", [False, True])
def test_mtp_flops_are_a_layer_a_projection_and_logits(recompute):
    """Megatron-LM's num_floating_point_operations (training.py) adds, per MTP depth, one layer
    of the last layer's kind, the 2h -> h projection and a second logit layer (plus the
    norms, which parbench does not count as matrix multiplications): here the difference to
    the model without MTP, less one more MoE layer's, is 3 x (2 (2h) h + 2hV) per token --
    the logits never recomputed."""
    b, h, V = 2, 7168, 129280
    extra_layer = shape_training_flops(_v3(num_layers=62), b, recompute=recompute) \
        - shape_training_flops(_v3(), b, recompute=recompute)
    mtp = shape_training_flops(_v3(mtp_layers=1), b, recompute=recompute) \
        - shape_training_flops(_v3(), b, recompute=recompute)
    tokens = b * 4096
    proj = (4 if recompute else 3) * 2 * (2 * h) * h * tokens
    assert mtp - extra_layer == proj + 3 * 2 * h * V * tokens


def test_deepseek_v3_example_imports_mtp_yarn_and_sequence_balancing():
    argv = shlex.split(DEEPSEEK_V3_MODEL + DEEPSEEK_V3_MTP_YARN)
    case = from_megatron_args(argv)
    assert case.model.mtp_layers == 1
    assert total_params(shape_from(case.model)) - mtp_params(shape_from(case.model)) \
        == DEEPSEEK_V3_MAIN
    ignored = megatron_ignored(argv)
    for name in ("--rotary-scaling-factor", "--mscale", "--mscale-all-dim",
                 "--mtp-loss-scaling-factor", "--moe-router-force-load-balancing"):
        assert name in ignored
    assert "--mtp-num-layers" not in ignored


def test_estimate_prints_the_mtp_share_and_names_what_it_ignores(capsys):
    text = DEEPSEEK_V3_MODEL + DEEPSEEK_V3_MTP_YARN
    assert main(["estimate", f"megatron_args={text}", "ep=64", "dp=64", "--json"]) == 0
    out = capsys.readouterr()
    params = json.loads(out.out)["parameters"]
    assert params["mtp"] == mtp_params(_v3(mtp_layers=1))
    assert "--rotary-scaling-factor (YaRN" in out.err


def test_run_refuses_mtp_with_one_line():
    with pytest.raises(ConfigError, match="mtp_layers=1 is analytic only"):
        validate_runnable_model(ModelConfig(**{**PRESETS["llama-tiny"], "mtp_layers": 1}))


def test_mtp_activations_are_its_layer_its_projection_input_and_its_logits(capsys):
    """One MTP module on the last stage of ep=64 x dp=64, bf16: an MoE layer's Korthikanti
    count, the [h; emb] projection input (2h x s x b, 2 bytes) and a second set of logits."""
    assert main(["estimate", "model=deepseek-v3", "mtp_layers=1", "ep=64", "dp=64",
                 "--json"]) == 0
    act = json.loads(capsys.readouterr().out)["memory"]["activations"]
    proj_in = 2 * 7168 * 4096 * 1 * 2
    assert act["last_stage_mtp"] == act["per_moe_layer_korthikanti"] + proj_in \
        + act["last_stage_logits"]
