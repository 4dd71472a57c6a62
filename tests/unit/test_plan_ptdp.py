"""The PTD-P check (``parbench.plan_ptdp``): Table 1's rows become planner questions, and
the report says where the paper's (t, p, d) lands -- computed, never asserted to win."""
from __future__ import annotations

import pytest

from parbench.analytic.params import textbook_total_params
from parbench.plan import Space
from parbench.plan_ptdp import check_row, row_shape
from parbench.reproduce.ptdp import TABLE1


def test_rows_are_table1s_models():
    for i, (printed, a, h, l, *_rest) in enumerate(TABLE1, 1):  # noqa: E741
        shape = row_shape(i)
        assert (shape.a, shape.h, shape.l, shape.s) == (a, h, l, 2048)
        assert textbook_total_params(h, l, 51200, 2048) / 1e9 == \
            pytest.approx(float(printed), rel=0.03)  # row 1: 2 digits


def test_the_check_reports_where_the_papers_layout_lands():
    space = Space(micro_batch_sizes=(1, 2), zero_stages=(0, 1), max_cp=1,
                  recomputes=("none", "selective"), schedules=("1f1b", "interleaved"))
    chk = check_row(1, space=space, keep=20)
    assert chk.paper == (1, 1, 32) and chk.world == 32 and chk.batch == 512
    steps = [x[-1] for x in chk.top]
    assert steps == sorted(steps) and chk.ranked == len(chk.top) > 3
    degrees = [(x[0], x[2], x[3]) for x in chk.top]
    assert chk.in_top3 == (chk.paper in degrees[:3])
    if chk.paper_rank is not None:
        assert degrees[chk.paper_rank - 1] == chk.paper
        assert chk.paper not in degrees[:chk.paper_rank - 1]
    else:
        assert chk.paper not in degrees
    assert chk.line().startswith("row 1 (1.7B, n=32, B=512)")
