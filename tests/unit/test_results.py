"""The typed row: its groups survive a JSON round trip, a flat row of the earlier format maps
onto them figure by figure, a failure reads as one line, and a results file's bad lines are
named on stderr."""
from __future__ import annotations

import json

import pytest

from parbench.layout import Layout
from parbench.results import (BubbleFigures, Environment, Failure, FirstFailure, Memory,
                              ModelStates, OpTally, Row, RowCase, Timing, Tolerance, Traffic,
                              Verdict, append_row, load_rows)

#: a flat row as parbench 0.1 wrote it (pipeline.1f1b on pp=2, one failing gradient)
FLAT = {
    "id": "pipeline.1f1b:pp2:0123abcd", "suite": "pipeline", "scheme": "pipeline.1f1b",
    "family": "pipeline", "baseline_of": None, "world_size": 2,
    "degrees": {"tp": 1, "cp": 1, "ep": 1, "dp": 1, "pp": 2, "vpp": 1}, "model": "tiny-4l",
    "case": {"id": "pipeline.1f1b:pp2:0123abcd", "model": {"name": "tiny-4l"},
             "layout": {"pp": 2, "num_microbatches": 4, "micro_batch_size": 1},
             "run": {"scheme": "pipeline.1f1b", "steps": 2}},
    "status": "ok", "failure": None, "equivalent": False, "golden_ok": False,
    "update_ok": True, "max_loss_abs": 1e-7, "max_grad_abs": 0.5, "max_param_abs": 2e-6,
    "tolerance": {"rtol": 1e-5, "atol": 1e-6, "param_atol": 1e-4}, "uncovered": [],
    "first_failure": {"step": 1, "rank": 0, "what": "gradient", "tensor": "blocks.0.fc1.weight",
                      "max_abs": 0.5, "tolerance": 1.5e-6},
    "losses": [4.5, 4.4], "golden_losses": [4.5, 4.4], "golden_source": "live",
    "step_time_s": 0.02, "step_times_s": [[0.02, 0.021], [0.019, 0.02]], "tokens_per_s": 800.0,
    "peak_bytes": [9000, 8000], "peak_bytes_predicted": None, "other_peak_bytes": [5000, 4500],
    "model_state_bytes": [{"params": 1000, "grads": 1000, "optimizer": 2000},
                          {"params": 900, "grads": 900, "optimizer": 1700}],
    "model_state_bytes_predicted": [{"params": 1000, "grads": 1000, "optimizer": 2000},
                                    {"params": 900, "grads": 900, "optimizer": 1700}],
    "wire_bytes": {"pp": 4096.0}, "wire_bytes_per_rank": [{"pp": 2048.0}, {"pp": 4096.0}],
    "wire_bytes_predicted": {"pp": 4096.0},
    "wire_bytes_predicted_per_rank": [{"pp": 2048.0}, {"pp": 4096.0}],
    "wire_exact": True, "calls_exact": True, "model_state_exact": True,
    "calls_per_rank": [{"pp": 4}, {"pp": 8}], "calls_predicted_per_rank": [{"pp": 4}, {"pp": 8}],
    "max_update_excess": 0.0, "detectable_wd_error": 9.5e-4,
    "prediction": {"params": 12345, "paper": {"model_state_bytes": {"mixed_adam": {
        "param": 10.0, "grad": 10.0, "optim": 60.0, "total": 80.0}}}},
    "ledger_summary": {"pp/recv": {"count": 4, "message_bytes": 2048, "wire_bytes": 0.0},
                       "pp/send": {"count": 4, "message_bytes": 2048, "wire_bytes": 2048.0}},
    "extra": {"schedule": "1f1b p=2 m=4 v=1", "held_graphs": "2/1 (sim 2/1)",
              "activation_peak_bytes": [3000, 2500], "bubble_measured": 0.3,
              "bubble_replayed": 0.25, "bubble_sim_mean_costs": 0.24, "bubble_unit": 0.2,
              "bubble_closed_form": 0.2, "bubble_detail": {"steps_measured": 3},
              "moe_load_imbalance": 1.5},
    "figures": ["f.png"], "trace": "t.json", "host_cpus": 2, "torch": "2.x", "python": "3.11",
}


def test_a_flat_row_maps_onto_the_groups():
    r = Row.from_dict(FLAT)
    assert (r.id, r.scheme, r.case.family, r.case.model) == (
        FLAT["id"], "pipeline.1f1b", "pipeline", "tiny-4l")
    assert r.case.layout == Layout(pp=2, num_microbatches=4, micro_batch_size=1)
    assert r.case.degrees() == FLAT["degrees"] and r.case.world_size == FLAT["world_size"]
    v = r.verdict
    assert (v.equivalent, v.golden_ok, v.update_ok) == (False, False, True)
    assert v.tolerance == Tolerance(**FLAT["tolerance"])
    assert v.first_failure == FirstFailure(**FLAT["first_failure"])
    assert (v.losses, v.detectable_wd_error) == (FLAT["losses"], FLAT["detectable_wd_error"])
    assert r.time == Timing(FLAT["step_time_s"], FLAT["step_times_s"], FLAT["tokens_per_s"])
    assert r.memory.peak_bytes == FLAT["peak_bytes"]
    assert r.memory.other_peak() == FLAT["other_peak_bytes"]
    assert r.memory.states == ModelStates(FLAT["model_state_bytes"],
                                          FLAT["model_state_bytes_predicted"], True, 80.0)
    t = r.traffic
    assert (t.wire, t.calls) == (FLAT["wire_bytes_per_rank"], FLAT["calls_per_rank"])
    assert t.wire_max() == FLAT["wire_bytes"]
    assert t.wire_predicted_max() == FLAT["wire_bytes_predicted"]
    assert t.ops == [OpTally("pp", "recv", 4, 2048, 0.0), OpTally("pp", "send", 4, 2048, 2048.0)]
    extra = FLAT["extra"]
    assert r.pipeline == BubbleFigures(
        schedule=extra["schedule"], measured=0.3, replayed=0.25, sim_mean_costs=0.24, unit=0.2,
        closed_form=0.2, held_graphs=extra["held_graphs"],
        activation_peak_bytes=extra["activation_peak_bytes"], detail=extra["bubble_detail"])
    assert r.scheme_figures == {"moe_load_imbalance": 1.5}
    assert r.analytic == FLAT["prediction"]
    assert r.env == Environment(2, "2.x", "3.11", "t.json", ["f.png"])
    assert not r.passed and r.exact and r.shares_cores is False


def test_a_row_survives_its_json_and_keeps_its_format():
    r = Row(case=RowCase(id="x", scheme="data.ddp", layout=Layout(dp=2), config={"id": "x"}),
            verdict=Verdict(status="failed", failure=Failure("hung", 1, "no progress", "tb"),
                            first_failure=FirstFailure("loss", "loss", 1.0, 0.5, step=0, rank=1),
                            tolerance=Tolerance(1e-5, 1e-6, 1e-4)),
            memory=Memory([10, None], 12.5, ModelStates([{"params": 4}, None], None, None)),
            traffic=Traffic([{"dp": 1.0}], [{"dp": 1}], ops=[OpTally("dp", "all_reduce", 1)]),
            pipeline=BubbleFigures(replayed=0.1, detail={"a": [1, 2]}),
            scheme_figures={"k": [1]}, env=Environment(host_cpus=4))
    d = json.loads(json.dumps(r.to_dict()))
    assert d["format"] == 2 and Row.from_dict(d) == r
    d["verdict"]["from_the_future"] = 1  # a newer file's field is ignored
    assert Row.from_dict(d) == r


def test_first_failure_is_one_line_with_where_what_and_how_much():
    f = FirstFailure("gradient", "blocks.0.ln1.weight", 0.01, 1.01e-6, step=1, rank=1)
    assert str(f) == ("step 1, rank 1: gradient 'blocks.0.ln1.weight': max|ours - golden| = "
                      "0.01 > tolerance 1.01e-06")
    assert str(FirstFailure("update", "(optimizer step)", 37.0, 1.0, step=0, rank=0)) == (
        "step 0, rank 0: update '(optimizer step)': the step is 37 x its tolerance off the "
        "run's optimizer applied to the reported gradients")
    assert str(FirstFailure("uncovered", "w", detail="1 golden parameter(s) reported by no "
                            "rank")) == "uncovered 'w' (1 golden parameter(s) reported by no rank)"
    assert "does not record which tensor" in str(FirstFailure("parameter", max_abs=1.0))


def test_load_rows_names_the_lines_it_leaves_out(tmp_path, capsys):
    p = tmp_path / "results.jsonl"
    append_row(p, Row.from_dict(FLAT))
    with open(p, "a") as fh:
        fh.write("not json\n" + json.dumps(FLAT) + "\n" + '{"no_id": 1}\n' + '{"id": "c", "x"')
    rows = load_rows(tmp_path)
    assert [r.id for r in rows] == [FLAT["id"]] * 2
    err = capsys.readouterr().err
    assert "left out 3 line(s) that are not results rows: line 2, 4, 5" in err, err


@pytest.mark.parametrize("bad", [[], "text", {"id": "x", "case": "text"}])
def test_a_row_of_the_wrong_shape_is_an_error_not_a_row(bad):
    with pytest.raises((TypeError, AttributeError, ValueError)):
        Row.from_dict(bad)
