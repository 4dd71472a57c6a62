"""Published tables reproduced by the tool (``parbench reproduce NAME|all``).

One module per paper. Each holds the published cells as data with their source (paper, table
or figure, and whether the values could be checked against a text copy), the configuration
that reproduces them (each value with where it comes from), and a ``reproduce()`` that
computes the tool's figure for every cell at run time with ``parbench.analytic`` or
``parbench.schedules`` (``throughput``: the time model) and returns a
:class:`~.core.Reproduction`. :mod:`.render` writes it
as markdown: per table the source, the configuration, per cell published . tool . relative
error, and the line "N of M cells within X%".

    >>> from parbench.reproduce import run
    >>> run("ptdp").ok
    True
"""
from __future__ import annotations

from typing import Callable

from . import bubbles, deepseek_v3, korthikanti, ptdp, throughput, ubmesh, zero, zero_bubble
from .core import Cell, Reproduction, Setting, Source, Table
from .render import render_markdown, write_markdown

#: name -> the function that builds the reproduction, in listing order
REPRODUCTIONS: dict[str, Callable[[], Reproduction]] = {
    "zero": zero.reproduce,
    "korthikanti": korthikanti.reproduce,
    "ptdp": ptdp.reproduce,
    "zero-bubble": zero_bubble.reproduce,
    "deepseek-v3": deepseek_v3.reproduce,
    "bubbles": bubbles.reproduce,
    "ubmesh": ubmesh.reproduce,
    "throughput": throughput.reproduce,
}


def names() -> list[str]:
    return list(REPRODUCTIONS)


def run(name: str) -> Reproduction:
    """The reproduction ``name``; ``KeyError`` listing the known names otherwise."""
    if name not in REPRODUCTIONS:
        raise KeyError(f"{name!r} (choose from {', '.join(REPRODUCTIONS)}, all)")
    return REPRODUCTIONS[name]()


__all__ = ["REPRODUCTIONS", "Cell", "Reproduction", "Setting", "Source", "Table", "names",
           "render_markdown", "run", "write_markdown"]
