"""``parbench plan`` says how sure it is and counts memory as ``estimate`` does (issue 22,
sec. 2): the device line names a calibrated profile or a datasheet bound, ``accounting=`` and
``attention=`` are accepted and checked, and reach the memory figure."""
from __future__ import annotations

import json

import pytest

from parbench.cli import main

ARGS = ["plan", "model=small", "world=8", "device=a100-80gb", "global_batch_size=16",
        "top=3", "schedules=1f1b"]


def test_plan_says_a_preset_is_a_datasheet_bound(capsys):
    assert main(ARGS) == 0
    out = capsys.readouterr().out
    assert "uncalibrated preset: datasheet" in out
    assert main(ARGS + ["--json"]) == 0
    js = json.loads(capsys.readouterr().out)
    assert js["calibrated"] is False and "datasheet" in js["device_kind"]


def test_plan_says_a_calibrated_profile_is_calibrated(capsys, tmp_path):
    from parbench.timemodel import load_profile
    prof = load_profile("a100-80gb")
    prof.calibrated = True
    path = prof.save(tmp_path / "measured.json")
    args = [a if not a.startswith("device=") else f"device={path}" for a in ARGS]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "calibrated profile" in out and "datasheet" not in out


def test_plan_counts_memory_with_the_accounting_and_attention_given(capsys):
    mems = {}
    for extra in ([], ["accounting=megatron"], ["attention=flash"]):
        assert main(ARGS + extra + ["--json"]) == 0
        js = json.loads(capsys.readouterr().out)
        mems[tuple(extra)] = (js["accounting"], js["attention"], js["ranked"][0])
    assert mems[()][:2] == ("mixed_adam", "eager")
    assert mems[("accounting=megatron",)][:2] == ("megatron", "eager")
    assert mems[("attention=flash",)][:2] == ("mixed_adam", "flash")
    assert mems[("accounting=megatron",)][2]["accounting"] == "megatron"
    assert mems[("attention=flash",)][2]["attention"] == "flash"


@pytest.mark.parametrize("bad, says", [("accounting=nine", "accounting"),
                                       ("attention=sparse", "attention")])
def test_plan_refuses_a_bad_counting_in_one_line(capsys, bad, says):
    assert main(ARGS + [bad]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1
