"""The analytic verbs in-process: overrides of a preset's shape, Megatron import."""
from __future__ import annotations

import json

import pytest

from parbench.cli import main
from parbench.config import PRESETS


def params_of(capsys, *args) -> float:
    assert main(["estimate", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)["parameters"]["total"]


def reference_params(L, h, V, s, f=None, tied=False, pos=True) -> int:  # noqa: N803
    """Narayanan et al. 2021 Sec. 5.1 per layer, 4h^2 + 2hf + f + 9h (12h^2 + 13h for f = 4h),
    plus the token embedding, learned positions, the final LayerNorm and an untied head."""
    f = f or 4 * h
    return L * (4 * h * h + 2 * h * f + f + 9 * h) + V * h + (s * h if pos else 0) + 2 * h \
        + (0 if tied else V * h)


def test_gpt3_with_a_smaller_hidden_size(capsys):
    """The FFN follows the overridden hidden size (4h), it is not the preset's 4 x 12288."""
    got = params_of(capsys, "model=gpt3-175b", "hidden_size=1024", "num_heads=8")
    assert got == reference_params(96, 1024, 51200, 2048, tied=True)
    assert abs(got - 1.26e9) / 1.26e9 < 0.01


@pytest.mark.parametrize("preset", sorted(p for p in PRESETS if not PRESETS[p].get("num_experts")
                                           and PRESETS[p].get("mlp", "gelu") == "gelu"))
def test_hidden_size_override_for_every_preset(capsys, preset):
    spec = PRESETS[preset]
    h = 2 * spec["num_heads"] * 8
    got = params_of(capsys, f"model={preset}", f"hidden_size={h}")
    want = reference_params(spec["num_layers"], h, spec["vocab_size"], spec["seq_length"],
                            spec.get("ffn_hidden_size"), spec.get("tie_embeddings", False),
                            spec.get("position_embeddings", True))
    assert got == want


def test_megatron_arguments_on_the_command_line(capsys):
    got = params_of(capsys, "megatron_args=--num-layers 2 --hidden-size 64 "
                            "--num-attention-heads 4 --seq-length 32 --vocab-size 128")
    assert got == reference_params(2, 64, 128, 32, tied=True)
