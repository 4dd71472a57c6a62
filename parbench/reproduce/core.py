"""The record every reproduction returns: published cells beside the tool's figures.

A :class:`Reproduction` holds one or more :class:`Table` s. A table names its source
(:class:`Source`: paper, table or figure, where it was checked), the configuration its cells
are computed from (each entry with where its value comes from), how the tool computes its
figure, and a relative-error tolerance. A :class:`Cell` holds the published value -- as
printed where the paper prints a number (``printed``), or the paper's formula evaluated
where the paper publishes a formula -- and the tool's figure, computed at run time.

A cell is *within* when its relative error is at most the table's tolerance. A cell outside
it may carry an explanation of a known cause (a printing error the rest of the table
exposes, say); it is then *explained*, not a miss. :func:`Table.summary` gives the line
"N of M cells within X%".

A *goal* table (``goal=True``) puts the tool's predictions beside published measurements
the tool aims to reproduce (the time model against published training runs): its misses are
reported as misses in every summary, and do not decide :attr:`Reproduction.ok`, which stays
the verdict on published formulas and figures the tool must reproduce.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from decimal import Decimal
from fractions import Fraction
from math import floor


@dataclass(frozen=True)
class Source:
    """Where published values come from.

    paper: authors, year, title and an identifier (arXiv number); where: the table, figure or
    section; checked: how the values were confirmed for this module ("confirmed against ...")
    or ``"unconfirmed: ..."`` when no text copy could be consulted.
    """

    paper: str
    where: str
    checked: str = ""

    @property
    def confirmed(self) -> bool:
        return not self.checked.startswith("unconfirmed")


@dataclass(frozen=True)
class Setting:
    """One entry of a table's configuration: its value and where the value comes from."""

    name: str
    value: str
    source: str = ""


def _decimals(printed: str) -> int:
    return len(printed.split(".")[1]) if "." in printed else 0


def _round_half_up(x: float, decimals: int) -> Decimal:
    q = floor(Fraction(x) * 10 ** decimals + Fraction(1, 2))
    return Decimal(q).scaleb(-decimals)


def _truncate(x: float, decimals: int) -> Decimal:
    q = floor(Fraction(x) * 10 ** decimals)
    return Decimal(q).scaleb(-decimals)


@dataclass
class Cell:
    """One published figure beside the tool's.

    label: what the cell is (row and column of the paper's table); published: the paper's
    value (``float(printed)`` when printed is given); tool: the tool's figure; unit: shared
    by both; printed: the number as the paper prints it, which fixes the printed precision;
    note: a known cause when the cell is off (``explained`` then says it is not a miss), or
    any remark; unconfirmed: this cell's published value could not be checked against a
    text copy of the paper.
    """

    label: str
    published: float
    tool: float
    unit: str = ""
    printed: str | None = None
    note: str = ""
    explained: bool = False
    unconfirmed: bool = False

    @property
    def rel_error(self) -> float:
        """|tool - published| / |published|; for a published 0, 0 when the tool's figure is 0
        too (within 1e-12) and infinity otherwise."""
        if self.published == 0:
            return 0.0 if abs(self.tool) <= 1e-12 else math.inf
        return abs(self.tool - self.published) / abs(self.published)

    def within(self, tolerance: float) -> bool:
        return self.rel_error <= tolerance

    @property
    def at_printed_precision(self) -> str | None:
        """How the tool's figure compares with the printed number at its printed precision:
        ``"rounds"`` (rounded half-up it is the printed number), ``"truncates"`` (cut off at
        the printed digits it is), ``"differs"``; None when nothing is printed."""
        if self.printed is None:
            return None
        d = _decimals(self.printed)
        want = Decimal(self.printed)
        if _round_half_up(self.tool, d) == want:
            return "rounds"
        if _truncate(self.tool, d) == want:
            return "truncates"
        return "differs"

    def to_dict(self, tolerance: float) -> dict:
        out = {"label": self.label, "published": self.published, "tool": self.tool,
               "unit": self.unit, "rel_error": self.rel_error,
               "within": self.within(tolerance), "explained": self.explained}
        for key in ("printed", "note"):
            if getattr(self, key):
                out[key] = getattr(self, key)
        if self.printed is not None:
            out["at_printed_precision"] = self.at_printed_precision
        if self.unconfirmed:
            out["unconfirmed"] = True
        return out


@dataclass
class Table:
    """One published table (or figure, or set of statements) and its reproduction."""

    key: str
    title: str
    source: Source
    config: list[Setting]
    method: str
    tolerance: float
    cells: list[Cell] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    goal: bool = False

    def __post_init__(self) -> None:
        if not self.source.confirmed:
            for c in self.cells:
                c.unconfirmed = True

    @property
    def n_within(self) -> int:
        return sum(c.within(self.tolerance) for c in self.cells)

    @property
    def misses(self) -> list[Cell]:
        """Cells outside the tolerance with no known cause."""
        return [c for c in self.cells if not c.within(self.tolerance) and not c.explained]

    @property
    def explained(self) -> list[Cell]:
        """Cells outside the tolerance whose cause is known (stated in their note)."""
        return [c for c in self.cells if not c.within(self.tolerance) and c.explained]

    @property
    def ok(self) -> bool:
        return not self.misses

    def summary(self) -> str:
        out = f"{self.n_within} of {len(self.cells)} cells within {fmt_percent(self.tolerance)}"
        if self.explained:
            out += f"; {len(self.explained)} outside it for a known cause"
        if self.misses:
            out += f"; {len(self.misses)} " + ("outside the goal" if self.goal
                                               else "unexplained")
        return out

    def to_dict(self) -> dict:
        return {"key": self.key, "title": self.title, "goal": self.goal,
                "source": {"paper": self.source.paper, "where": self.source.where,
                           "checked": self.source.checked},
                "config": [{"name": s.name, "value": s.value, "source": s.source}
                           for s in self.config],
                "method": self.method, "tolerance": self.tolerance,
                "summary": self.summary(), "ok": self.ok,
                "cells": [c.to_dict(self.tolerance) for c in self.cells],
                "notes": list(self.notes)}


@dataclass
class Reproduction:
    """A paper's tables reproduced by the tool."""

    name: str
    title: str
    tables: list[Table]
    intro: str = ""

    @property
    def cells(self) -> list[Cell]:
        return [c for t in self.tables for c in t.cells]

    @property
    def ok(self) -> bool:
        """Every table but the goal tables without a miss."""
        return all(t.ok for t in self.tables if not t.goal)

    def summary(self) -> str:
        """One line over every table: "N of M cells within their tolerance (X%, Y%)"."""
        n = sum(t.n_within for t in self.tables)
        tols = sorted({t.tolerance for t in self.tables})
        tol = fmt_percent(tols[0]) if len(tols) == 1 else \
            "their tables' tolerances (" + ", ".join(
                "exact" if t < 1e-6 else fmt_percent(t) for t in tols) + ")"
        out = f"{n} of {len(self.cells)} cells within {tol}"
        explained = sum(len(t.explained) for t in self.tables)
        misses = sum(len(t.misses) for t in self.tables if not t.goal)
        short = sum(len(t.misses) for t in self.tables if t.goal)
        if explained:
            out += f"; {explained} outside it for a known cause"
        if misses:
            out += f"; {misses} unexplained"
        if short:
            out += f"; {short} outside the goal"
        return out

    def to_dict(self) -> dict:
        return {"name": self.name, "title": self.title, "summary": self.summary(),
                "ok": self.ok, "tables": [t.to_dict() for t in self.tables]}


def fmt_percent(fraction: float) -> str:
    """A tolerance or relative error as text: 0.005 -> "0.5%"; a tolerance below 1e-6 is a
    demand for exact agreement up to floating-point rounding, "1e-09 (exact)"; a relative
    error below 1e-9 is "< 1e-9"."""
    if fraction == 0:
        return "0"
    if math.isinf(fraction):
        return "inf"
    if fraction < 1e-9:
        return "< 1e-9"
    if fraction < 1e-6:
        return f"{fraction:.0e} (exact)"
    pct = fraction * 100
    return f"{pct:.3g}%" if pct >= 0.01 else f"{pct:.1g}%"


def fmt_value(x: float) -> str:
    """A figure with six significant digits, integers without a fraction."""
    if x == int(x) and abs(x) < 1e15:
        return str(int(x))
    return f"{x:.6g}"
