"""scripts/validate_timemodel.py's statistics (scripts/validation_stats.py), on made-up
measurements (the script's runs are its own business: they take minutes on real ranks)."""
import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "validation_stats.py"


@pytest.fixture(scope="module")
def vt():
    spec = importlib.util.spec_from_file_location("validation_stats", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_repeatability_counts_each_repeat_against_the_mean_of_the_others(vt):
    # case 1: 10 vs mean(11, 12) = 11.5 -> 15% of 10: within; 11 vs 11: within; 12 vs 10.5
    # -> 12.5%: within. case 2: 10 vs 20: 100%, 20 vs 10: 50%: neither. A single repeat
    # and a missing list count for nothing.
    rows = [{"repeats_s": [10.0, 11.0, 12.0]}, {"repeats_s": [10.0, 20.0]},
            {"repeats_s": [5.0]}, {"repeats_s": None}]
    assert vt.repeatability(rows, 0.15) == (3, 5)
    # at 14.9% the first repeat of case 1 (an error of exactly 15%) is out
    assert vt.repeatability(rows, 0.149) == (2, 5)


def test_spearman_is_one_for_the_same_order_and_minus_one_reversed(vt):
    assert vt.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert vt.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
