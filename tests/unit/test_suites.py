"""Suite expansion and the append-only results file."""
from __future__ import annotations

import json

import pytest

from parbench.config import ConfigError
from parbench.layout import Layout
from parbench.results import Row, RowCase, Timing, append_row, load_rows
from parbench.suites import available_suites, check_suite, expand, load_suite


def test_grid_cases_defaults_and_command_line_overrides():
    spec = {"name": "x", "defaults": {"model": "tiny", "steps": 2},
            "grid": {"scheme": ["data.ddp", "baseline.torch.ddp"], "dp": [1, 2]},
            "cases": [{"scheme": "data.ddp", "dp": 4, "steps": 5}]}
    suite = expand(spec, {"lr": "0.01"})
    assert len(suite.cases) == 5
    assert all(c.run.lr == 0.01 and c.model.name == "tiny" for c in suite.cases)
    assert suite.cases[-1].run.steps == 5 and suite.cases[0].run.steps == 2
    assert len({c.id for c in suite.cases}) == 5


def test_identical_cases_are_run_once():
    suite = expand({"cases": [{"dp": 2}, {"dp": 2}]}, {})
    assert len(suite.cases) == 1


def test_bundled_suites_load_and_pass_every_check():
    for name in available_suites():
        check_suite(load_suite(name))


def test_unknown_suite_and_bad_world():
    with pytest.raises(ConfigError, match="suite='nope' does not exist"):
        load_suite("nope")
    with pytest.raises(ConfigError, match="world_size=3"):
        check_suite(load_suite("smoke"), world_size=3)


def test_results_are_appended_and_a_torn_line_is_skipped(tmp_path, capsys):
    p = tmp_path / "results.jsonl"
    def row(i, t):
        return Row(case=RowCase(id=i, suite="s", scheme="data.ddp", family="data",
                                model="tiny", layout=Layout(dp=2)), time=Timing(step_s=t))
    append_row(p, row("a", 1.0))
    append_row(p, row("b", 2.0))
    with open(p, "a") as fh:
        fh.write('{"id": "c", "x"')  # a run killed mid-write
    rows = load_rows(p)
    assert [r.id for r in rows] == ["a", "b"] and rows[1].time.step_s == 2.0
    assert rows[0] == row("a", 1.0)  # every group read back as written
    assert json.loads(p.read_text().splitlines()[0])["time"]["step_s"] == 1.0
    assert "left out 1 line(s) that are not results rows: line 3" in capsys.readouterr().err
