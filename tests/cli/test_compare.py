"""``parbench compare OLD NEW``: the pure functions on synthetic rows, the verb's exit
statuses and messages, and two real runs end to end (same suite: 0; a heavier scheme: 1)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import SUBPROCESS_TIMEOUT_S
from parbench.results import Failure, Row, append_row
from parbench.report.compare import (TIME_FLOOR, TIME_K, Options, compare_rows,
                                     match_rows, read_rows, relative_spread, time_diff,
                                     verdict_of)

ROOT = Path(__file__).resolve().parents[2]


def flat(scheme="data.ddp", rid=None, **kw) -> dict:
    """A finished, passing native DDP row on dp=2 with deterministic figures, as the flat JSON
    object earlier versions wrote (``parbench.results.flat``)."""
    case = {"model": {"name": "tiny"}, "parallel": {"dp": 2},
            "run": {"scheme": scheme, "steps": 2}, "id": ""}
    base = dict(
        id=rid or f"{scheme}:dp2:abcd1234", suite="t", scheme=scheme, family="data",
        baseline_of=None, world_size=2, degrees={"tp": 1, "cp": 1, "ep": 1, "dp": 2, "pp": 1,
                                                 "vpp": 1},
        model="tiny", case=case, equivalent=True, golden_ok=True, update_ok=True,
        wire_exact=True, calls_exact=True, model_state_exact=True,
        wire_bytes={"dp": 1000.0}, wire_bytes_per_rank=[{"dp": 1000.0}, {"dp": 1000.0}],
        calls_per_rank=[{"dp": 2}, {"dp": 2}],
        model_state_bytes=[{"params": 400, "grads": 400, "optimizer": 800}] * 2,
        peak_bytes=[5000, 5000], step_time_s=0.010,
        step_times_s=[[0.010, 0.0102, 0.0098], [0.010, 0.0101, 0.0099]])
    base.update(kw)
    return base


def row(scheme="data.ddp", rid=None, **kw) -> Row:
    """``flat``'s row, read as ``load_rows`` reads a file of an earlier version."""
    return Row.from_dict(flat(scheme, rid, **kw))


def only(diffs):
    assert len(diffs) == 1
    return diffs[0]


# ---- pure functions ----------------------------------------------------------------------


def test_identical_rows_are_ok():
    d = only(compare_rows([row()], [row()]))
    assert d.status == "ok" and not d.regression and not d.reasons
    assert d.verdict == ("pass", "pass")
    assert d.time.source == "auto" and d.time.ratio == pytest.approx(1.0)


def test_wire_bytes_up_on_one_axis_is_a_regression_naming_the_axis():
    new = row(wire_bytes_per_rank=[{"dp": 1000.0}, {"dp": 1008.0}])
    d = only(compare_rows([row()], [new]))
    assert d.regression and d.status == "regression"
    assert d.reasons == ["wire dp: +8 B (+0.8%)"], d.reasons
    assert d.wire == {"dp": [1000.0, 1008.0]}


def test_bytes_tol_tolerates_a_relative_increase_and_down_is_an_improvement():
    new = row(wire_bytes_per_rank=[{"dp": 1008.0}] * 2)
    assert not only(compare_rows([row()], [new], Options(bytes_tol=0.01))).regression
    assert only(compare_rows([row()], [new], Options(bytes_tol=0.005))).regression
    down = only(compare_rows([row()], [row(wire_bytes_per_rank=[{"dp": 900.0}] * 2)]))
    assert not down.regression and down.improvements == ["wire dp: -100 B (-10.0%)"]


def test_new_axis_and_extra_call_are_regressions():
    new = row(wire_bytes_per_rank=[{"dp": 1000.0, "tp": 4.0}] * 2,
              calls_per_rank=[{"dp": 3}, {"dp": 2}])
    d = only(compare_rows([row()], [new], Options(bytes_tol=0.4)))
    assert d.reasons == ["wire tp: +4 B", "calls dp: +1 (+50.0%)"], d.reasons


def test_states_and_peak_up_on_one_rank_are_regressions_naming_the_rank():
    new = row(model_state_bytes=[{"params": 400, "grads": 400, "optimizer": 800},
                                 {"params": 400, "grads": 800, "optimizer": 800}],
              peak_bytes=[5000, 5001])
    d = only(compare_rows([row()], [new]))
    assert d.reasons == ["states r1: +400 B (+25.0%)", "peak r1: +1 B (+0.02%)"], d.reasons


def test_verdict_lost_is_a_regression_and_regained_an_improvement():
    failed = row(status="failed", equivalent=False,
                 failure=Failure(kind="hung", rank=1, message="no progress"))
    d = only(compare_rows([row()], [failed]))
    assert d.verdict == ("pass", "HUNG") and d.reasons == ["verdict: pass → HUNG"]
    assert d.time.ratio is None and d.time.note == "no timed steps"
    d = only(compare_rows([row()], [row(equivalent=False)]))
    assert d.reasons == ["verdict: pass → FAIL"]
    d = only(compare_rows([row()], [row(wire_exact=False)]))
    assert verdict_of(row(wire_exact=False)) == "inexact"
    assert d.reasons == ["verdict: pass → inexact"]
    # a baseline off the closed form still passes: differences are findings there
    assert verdict_of(row(baseline_of="data.ddp", wire_exact=False)) == "pass"
    back = only(compare_rows([row(equivalent=False)], [row()]))
    assert not back.regression and back.improvements == ["verdict: FAIL → pass"]


def test_a_baselines_figures_are_findings_unless_gated():
    """As in ``run``'s verdict: a baseline's bytes and time are shown, its verdict gates.
    (torch's FSDP2 peak on CPU moved by 6% between two runs of the smoke suite.)"""
    base = dict(scheme="baseline.torch.fsdp2", rid="baseline.torch.fsdp2:dp2:1",
                baseline_of="zero.3")
    new = row(peak_bytes=[5000, 5852], step_time_s=0.05, **base)
    d = only(compare_rows([row(**base)], [new]))
    assert not d.regression and d.status == "ok"
    assert d.findings == ["peak r1: +852 B (+17.0%)",
                          "time: 5.00× > 1.10× (auto threshold)"], d.findings
    d = only(compare_rows([row(**base)], [new], Options(gate_baselines=True)))
    assert d.regression and len(d.reasons) == 2
    d = only(compare_rows([row(**base)], [row(equivalent=False, **base)]))
    assert d.regression and d.reasons == ["verdict: pass → FAIL"]


def test_missing_row_is_a_regression_new_row_is_not():
    a, b, c = row(), row(rid="zero.1:dp2:1", scheme="zero.1"), row(rid="zero.2:dp2:2",
                                                                  scheme="zero.2")
    diffs = {d.key: d for d in compare_rows([a, b], [a, c])}
    assert diffs[b.id].status == "missing" and diffs[b.id].regression
    assert diffs[b.id].reasons == ["missing: in OLD, not in NEW"]
    assert diffs[c.id].status == "new" and not diffs[c.id].regression
    assert diffs[a.id].status == "ok"


def test_no_case_in_common_is_bad_input():
    from parbench.config import ConfigError
    with pytest.raises(ConfigError, match="no case in common"):
        compare_rows([row()], [row(rid="other")])


def test_time_within_noise_is_ok_beyond_is_a_regression():
    noisy = [[0.010, 0.012, 0.008], [0.010, 0.011, 0.009]]  # about ±15% per step
    old = row(step_times_s=noisy)
    s = relative_spread(noisy)
    thr = max(TIME_FLOOR, TIME_K * (2 * s * s) ** 0.5)
    assert 0.3 < thr < 1.5
    within = row(step_time_s=0.010 * (1 + 0.9 * thr), step_times_s=noisy)
    beyond = row(step_time_s=0.010 * (1 + 1.1 * thr), step_times_s=noisy)
    assert only(compare_rows([old], [within])).status == "ok"
    d = only(compare_rows([old], [beyond]))
    assert d.regression and d.reasons[0].startswith("time: ") and "auto threshold" in \
        d.reasons[0]
    assert d.time.threshold == pytest.approx(thr)


def test_quiet_steps_give_the_floor_and_a_small_slowdown_is_caught():
    quiet = [[0.010, 0.010, 0.010]] * 2
    old = row(step_times_s=quiet)
    d = only(compare_rows([old], [row(step_time_s=0.010 * (1 + 1.2 * TIME_FLOOR),
                                      step_times_s=quiet)]))
    assert d.time.threshold == pytest.approx(TIME_FLOOR) and d.regression
    assert not only(compare_rows([old], [row(step_time_s=0.010 * (1 + 0.8 * TIME_FLOOR),
                                             step_times_s=quiet)])).regression


def test_time_tol_fixed_ignore_time_and_old_files_without_step_times():
    slow = row(step_time_s=0.015)
    assert only(compare_rows([row()], [slow], Options(time_tol=0.6))).status == "ok"
    d = only(compare_rows([row()], [slow], Options(time_tol=0.2)))
    assert d.regression and d.time.source == "fixed"
    d = only(compare_rows([row()], [slow], Options(ignore_time=True)))
    assert not d.regression and d.time.note == "ignored"
    # a row written before step_times_s existed: no automatic time verdict
    old_file = row(step_times_s=[])
    t = time_diff(old_file, slow, Options())
    assert t.threshold is None and t.note == "no repeated steps"
    assert not only(compare_rows([old_file], [slow])).regression
    # a single timed step per rank is not a repeat either
    assert relative_spread([[0.01], [0.01]]) is None


def test_match_config_pairs_the_same_case_across_schemes():
    old = row()
    heavy = row(scheme="mutant.ddp-debug-allreduce", rid="mutant:dp2:ffff",
                wire_bytes_per_rank=[{"dp": 1004.0}] * 2, calls_per_rank=[{"dp": 3}] * 2)
    with pytest.raises(Exception, match="no case in common"):
        compare_rows([old], [heavy])
    (k, o, n), = match_rows([old], [heavy], "config")
    assert o is old and n is heavy
    d = only(compare_rows([old], [heavy], Options(match="config")))
    assert d.regression and d.label == "data.ddp → mutant.ddp-debug-allreduce dp2"
    # two schemes on one configuration in one run: ambiguous
    with pytest.raises(Exception, match="same case configuration"):
        compare_rows([old, row(scheme="zero.1", rid="z")], [heavy], Options(match="config"))


def test_read_rows_loads_old_files_and_rejects_bad_ones(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    r = row().to_dict()
    del r["time"]["per_rank_s"]  # a file written before the field existed
    r["some_future_field"] = 1
    r["verdict"]["some_future_field"] = 1
    f = d / "results.jsonl"
    f.write_text(json.dumps(r) + "\n" + json.dumps(r)[:40] + "\n")  # truncated last line
    rows = read_rows(d)
    assert len(rows) == 1 and rows[0].time.per_rank_s == []
    from parbench.config import ConfigError
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n" + json.dumps(r) + "\n")
    with pytest.raises(ConfigError, match="line 1 is not a results row"):
        read_rows(bad)
    with pytest.raises(ConfigError, match="has no rows"):
        read_rows(_touch(tmp_path / "empty.jsonl"))
    with pytest.raises(ConfigError, match="does not exist"):
        read_rows(tmp_path / "nope")
    with pytest.raises(ConfigError, match="has no results.jsonl"):
        read_rows(tmp_path)


def _touch(p: Path) -> Path:
    p.write_text("")
    return p


# ---- the verb ----------------------------------------------------------------------------


def parbench(*args, timeout=SUBPROCESS_TIMEOUT_S):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["COLUMNS"] = "200"
    return subprocess.run([sys.executable, "-m", "parbench.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, env=env)


def _write(path: Path, rows: list[Row]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for r in rows:
        append_row(path / "results.jsonl", r)
    return path


def test_cli_exit_statuses_and_regression_lines(tmp_path):
    a = _write(tmp_path / "a", [row(), row(scheme="zero.1", rid="zero.1:dp2:1")])
    same = _write(tmp_path / "same", [row(), row(scheme="zero.1", rid="zero.1:dp2:1")])
    worse = _write(tmp_path / "worse", [
        row(peak_bytes=[5000, 6024]), row(scheme="zero.1", rid="zero.1:dp2:1")])
    p = parbench("compare", str(a), str(same))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "data.ddp dp2" in p.stdout and "no regression" not in p.stderr
    assert p.stderr == ""
    p = parbench("compare", str(a), str(worse / "results.jsonl"))
    assert p.returncode == 1, p.stdout + p.stderr
    lines = p.stderr.strip().splitlines()
    assert lines == ["parbench: regression: data.ddp dp2 [data.ddp:dp2:abcd1234]: "
                     "peak r1: +1 KiB (+20.5%)"], p.stderr
    assert "REGRESSION" in p.stdout
    p = parbench("compare", str(a), str(worse), "bytes_tol=0.25", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert [d["status"] for d in out] == ["ok", "ok"]
    assert out[0]["peak"] == {"r0": [5000, 5000], "r1": [5000, 6024]}
    assert {"key", "label", "verdict", "wire", "calls", "states", "peak", "time",
            "regression", "reasons", "improvements", "findings", "gated"} <= set(out[0])


def test_cli_compares_a_file_of_the_flat_format_with_one_of_this_format(tmp_path):
    """OLD written by an earlier version (flat rows), NEW by this one (grouped rows): the
    same figures compare equal, and a regression in NEW is named as in one format."""
    old = tmp_path / "old"
    old.mkdir()
    (old / "results.jsonl").write_text(
        "".join(json.dumps(flat(**kw)) + "\n"
                for kw in ({}, {"scheme": "zero.1", "rid": "zero.1:dp2:1"})))
    same = _write(tmp_path / "same", [row(), row(scheme="zero.1", rid="zero.1:dp2:1")])
    assert "format" in json.loads((same / "results.jsonl").read_text().splitlines()[0])
    p = parbench("compare", str(old), str(same))
    assert p.returncode == 0 and p.stderr == "", p.stdout + p.stderr
    worse = _write(tmp_path / "worse", [
        row(wire_bytes_per_rank=[{"dp": 1000.0}, {"dp": 1008.0}]),
        row(scheme="zero.1", rid="zero.1:dp2:1")])
    p = parbench("compare", str(old), str(worse))
    assert p.returncode == 1, p.stdout + p.stderr
    assert p.stderr.strip().splitlines() == [
        "parbench: regression: data.ddp dp2 [data.ddp:dp2:abcd1234]: wire dp: +8 B (+0.8%)"]
    # and the other way round, NEW in the flat format
    p = parbench("compare", str(worse), str(old))
    assert p.returncode == 0 and "better: wire" in p.stdout, p.stdout + p.stderr


@pytest.mark.parametrize("args, message", [
    (["compare", "/nonexistent/a", "/nonexistent/b"], "OLD=/nonexistent/a does not exist"),
    (["compare", "ONE"], "compare needs two results directories"),
    (["compare", "A", "B", "bogus=1"], "unknown key 'bogus' for compare"),
    (["compare", "A", "B", "time_tol=-1"], "time_tol=-1 must be >= 0"),
    (["compare", "A", "B", "match=scheme"], "match='scheme' must be one of id, config"),
    (["compare", "A", "B", "gate_baselines=maybe"], "gate_baselines='maybe' is not a boolean"),
])
def test_cli_bad_input_is_one_line_exit_2(args, message, tmp_path):
    p = parbench(*args)
    assert p.returncode == 2, p.stdout + p.stderr
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("parbench: error:"), p.stderr
    assert message in err[0]


def test_cli_unreadable_file_and_nothing_in_common_exit_2(tmp_path):
    good = _write(tmp_path / "good", [row()])
    other = _write(tmp_path / "other", [row(rid="x:dp2:0")])
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{\"id\": 1\n" + json.dumps(row().to_dict()) + "\n")
    p = parbench("compare", str(good), str(bad))
    assert p.returncode == 2 and "line 1 is not a results row" in p.stderr, p.stderr
    p = parbench("compare", str(good), str(other))
    assert p.returncode == 2 and "no case in common" in p.stderr, p.stderr


def test_cli_two_bench_all_files_pair_by_pair(tmp_path):
    """Two ``scripts/bench_all.py --json`` files: exit 1 naming the regressed pairs on stderr
    (a ratio risen with the repeat ranges apart, a pair without a figure, a missing pair), a
    noisy rise and a new pair in the table only; --json; a bench file beside results rows is
    bad input naming both."""
    from tests.unit.test_bench_compare import CASE, pair

    old, new = tmp_path / "old.json", tmp_path / "new.json"
    instr = {"kind": "instrument", "label": "data.ddp instruments on / off"}
    old.write_text(json.dumps([pair(0.90, 0.85, 0.95), pair(1.00, 0.70, 1.30, label="a / b"),
                               pair(**instr), pair(label="gone / b")], indent=1))
    new.write_text(json.dumps([pair(1.10, 1.00, 1.20), pair(1.25, 0.90, 1.50, label="a / b"),
                               pair(error="RuntimeError: boom", **instr),
                               pair(label="added / b")], indent=1))
    p = parbench("compare", str(old), str(new))
    assert p.returncode == 1, p.stdout + p.stderr
    assert p.stderr.strip().splitlines() == [
        f"parbench: regression: data.ddp / baseline.torch.ddp [{CASE}]: ratio: 0.900× → "
        "1.100× (1.22× > 1.10×; [0.850, 0.950] → [1.000, 1.200])",
        f"parbench: regression: data.ddp instruments on / off [{CASE}]: no figure: "
        "RuntimeError: boom",
        f"parbench: regression: gone / b [{CASE}]: missing: in OLD, not in NEW"], p.stderr
    assert "3 pair(s) matched, 1 new, 1 missing, 3 regression(s)" in p.stdout
    assert "ranges overlap" in p.stdout and "new ratio [low, high]" in p.stdout
    p = parbench("compare", str(old), str(new), "time_tol=0.3", "--json")
    assert p.returncode == 1, p.stderr
    assert [(d["label"], d["status"]) for d in json.loads(p.stdout)] == [
        ("data.ddp / baseline.torch.ddp", "ok"), ("a / b", "ok"),
        ("data.ddp instruments on / off", "regression"), ("gone / b", "missing"),
        ("added / b", "new")]
    rows = _write(tmp_path / "rows", [row()])
    p = parbench("compare", str(rows), str(new))
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stderr.strip() == (f"parbench: error: NEW={new} is bench_all's JSON (a list of "
                                f"pairs) but OLD={rows} is a results directory or rows file: "
                                "compare two bench_all files or two results directories")


# ---- end to end: two real runs -------------------------------------------------------------


def test_two_real_runs_then_a_heavier_scheme(shared_rank_pools, tmp_path, capsys):
    """The same one-case suite twice: nothing but time may move, and compare exits 0 (time
    is ignored for the gate here: two shared cores make 5 ms steps noisy). Then the same
    case run by a self-test mutant that adds a debugging all-reduce (scheme= override):
    matched with match=config, it exits 1 and names the row and the extra bytes."""
    suite = tmp_path / "tiny.yaml"
    suite.write_text("name: tiny\ndefaults: {model: tiny, dp: 2, steps: 2, timed_steps: 3}\n"
                     "cases:\n  - {scheme: data.ddp}\n")
    from parbench.cli import main
    runs = {}
    for name, extra in (("a", []), ("b", []),
                        ("heavy", ["scheme=mutant.ddp-debug-allreduce"])):
        runs[name] = tmp_path / name
        # in this process on the session's ranks (saves a torch import and two rank starts
        # per run); compare itself runs as a command
        rc = main(["run", f"suite={suite}", f"out={runs[name]}", *extra])
        # the mutant leaves its closed form: run says so with status 3
        assert rc == (3 if extra else 0), capsys.readouterr()
    p = parbench("compare", str(runs["a"]), str(runs["b"]), "ignore_time=true")
    assert p.returncode == 0, p.stdout + p.stderr
    # with the automatic threshold every figure but time is equal; time has a verdict
    p = parbench("compare", str(runs["a"]), str(runs["b"]), "--json")
    (d,) = json.loads(p.stdout)
    assert d["time"]["source"] == "auto" and d["time"]["threshold"] >= TIME_FLOOR
    assert all(r.startswith("time: ") for r in d["reasons"]), d["reasons"]
    assert p.returncode == (1 if d["reasons"] else 0)
    # the heavier scheme: its id differs (the scheme is part of it), so match=config
    p = parbench("compare", str(runs["a"]), str(runs["heavy"]))
    assert p.returncode == 2 and "no case in common" in p.stderr
    p = parbench("compare", str(runs["a"]), str(runs["heavy"]), "match=config",
                 "ignore_time=true")
    assert p.returncode == 1, p.stdout + p.stderr
    (line,) = p.stderr.strip().splitlines()
    assert line.startswith("parbench: regression: data.ddp → mutant.ddp-debug-allreduce dp2")
    assert "verdict: pass → inexact; wire dp: +4 B (+0.003%); calls dp: +1 (+100.0%)" in line
    assert "REGRESSION" in p.stdout
