"""``parbench plan`` as a user runs it: a ranked table (or JSON) on a published device
preset; bad input is one line, exit 2."""
from __future__ import annotations

import json

import pytest

from parbench.cli import main


def test_plan_ranks_layouts_that_fit(capsys):
    rc = main(["plan", "model=gpt3-175b", "world=64", "device=a100-80gb",
               "global_batch_size=64", "max_cp=1", "top=5", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["evaluated"] > 100 and len(out["ranked"]) == 5
    steps = [r["prediction"]["step_s"] for r in out["ranked"]]
    assert steps == sorted(steps)
    for r in out["ranked"]:
        lay, pred = r["layout"], r["prediction"]
        assert lay["tp"] * lay["cp"] * lay["dp"] * lay["pp"] == 64 and lay["cp"] == 1
        assert pred["fits"] and pred["memory_per_rank_bytes"] <= pred["device_memory_bytes"]


def test_plan_on_a_world_divisible_by_3_ranks_layouts_the_rules_accept(capsys):
    """``plan model=gpt3-175b world=96`` exited 1 with a traceback: tp=3 was proposed with
    sequence parallelism although 3 does not divide the 2048-token sequence."""
    from parbench.analytic.shape import shape_from
    from parbench.config import model_preset
    from parbench.layout import Layout
    rc = main(["plan", "model=gpt3-175b", "world=96", "device=a100-80gb", "top=5", "max_cp=1",
               "schedules=1f1b,interleaved", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["ranked"]
    shape = shape_from(model_preset("gpt3-175b"))
    for r in out["ranked"]:
        lay = Layout(**r["layout"])
        assert lay.world_size == 96
        lay.check_model(shape, sp=r["options"]["tensor"]["sp"])


def test_plan_verbose_prints_each_layouts_breakdown(capsys):
    args = ["plan", "model=gpt3-175b", "world=64", "device=a100-80gb",
            "global_batch_size=64", "max_cp=1", "top=2"]
    assert main(args) == 0
    short = capsys.readouterr().out
    assert main(args + ["--verbose"]) == 0
    out = capsys.readouterr().out
    assert "--verbose" in short and "step" in out and out.count("compute ") >= 2
    assert "= compute " in out and "= compute " not in short


@pytest.mark.parametrize("args, says", [
    (["model=gpt3-175b", "world=8"], "device="),
    (["model=nosuch", "world=8", "device=a100-80gb"], "nosuch"),
    (["model=gpt3-175b", "world=8", "device=a100-80gb", "colour=red"], "colour"),
    (["model=gpt3-175b", "world=0", "device=a100-80gb"], "world"),
])
def test_plan_bad_input(capsys, args, says):
    assert main(["plan", *args]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1
