"""Wire-byte formulas of the ledger, checked by hand."""
from __future__ import annotations

from fractions import Fraction

import pytest

from parbench.comm import record_wire as wire_bytes


@pytest.mark.parametrize("op, s, n, expected", [
    ("all_reduce", 1000, 4, Fraction(1500)),      # 2 * 3/4 * 1000
    ("all_reduce", 1000, 1, Fraction(0)),
    ("all_gather", 1024, 4, Fraction(768)),       # 3/4 * 1024
    ("reduce_scatter", 1024, 2, Fraction(512)),
    ("all_to_all", 900, 3, Fraction(600)),
    ("broadcast", 100, 8, Fraction(100)),
    ("send", 64, 2, Fraction(64)),
    ("recv", 64, 2, Fraction(0)),
])
def test_wire_bytes(op, s, n, expected):
    assert wire_bytes(op, s, n) == expected


def test_unknown_op():
    with pytest.raises(ValueError):
        wire_bytes("gossip", 1, 2)
