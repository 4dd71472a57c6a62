"""UB-Mesh (Liao et al. 2025), Table 1: traffic per parallelism of the in-house MoE-2T model.

The tool's figures are :func:`parbench.analytic.traffic.traffic_table` for the configuration
:class:`parbench.analytic.traffic.UBMeshMoE2T` (each field says whether it is sourced or
inferred); the published cells are :func:`published_ubmesh_table`. The two cells that do not
follow from the rest of the printed table are explained by
:func:`parbench.analytic.traffic.compare_with_published`, which is reused here.
"""
from __future__ import annotations

from dataclasses import fields
from fractions import Fraction

from ..analytic.shape import GiB, MiB
from ..analytic.traffic import (UBMeshMoE2T, compare_with_published, field_sources,
                                published_ubmesh_table, traffic_table)
from .core import Cell, Reproduction, Setting, Source, Table

PAPER = ("Liao et al. 2025, \"UB-Mesh: a Hierarchically Localized nD-FullMesh Datacenter "
         "Network Architecture\", arXiv 2503.20377")
COLUMNS = {"per_transfer": ("data volume per transfer", "MB"),
           "transfers": ("total transfers", ""), "total": ("total volume", "GB"),
           "share": ("share", "%")}


def _numbers(printed: str) -> list[str]:
    return printed.replace("MB", "").replace("GB", "").replace("%", "").strip().split("/")


def table1() -> Table:
    cfg = UBMeshMoE2T()
    rows = {r.parallelism: r for r in traffic_table(cfg)}
    checks = {(c.parallelism, c.column): c for c in compare_with_published(list(rows.values()))}
    cells = []
    for pub in published_ubmesh_table():
        name, row = pub["parallelism"], rows[pub["parallelism"]]
        tool = {"per_transfer": [Fraction(w) / MiB for w in row.per_transfer_bytes],
                "transfers": [Fraction(c) for c in row.counts],
                "total": [row.total_bytes / GiB], "share": [row.share * 100]}
        for col, (title, unit) in COLUMNS.items():
            printed = _numbers(pub[col])
            for i, (p, t) in enumerate(zip(printed, tool[col])):
                part = f" ({i + 1} of {len(printed)})" if len(printed) > 1 else ""
                c = Cell(f"{name} {pub['pattern']}: {title}{part}", float(p), float(t), unit,
                         printed=p)
                check = checks[(name, col)]
                if not check.ok and check.note:
                    c.note = check.note
                    c.explained = check.note.startswith("printing error")
                cells.append(c)
    sources = field_sources(cfg)
    config = [Setting(f.name, str(getattr(cfg, f.name)), sources.get(f.name, ""))
              for f in fields(cfg)]
    return Table(
        key="table1", title="Table 1: traffic per parallelism, one iteration (MB = 2^20 B, "
                            "GB = 2^30 B, bytes one rank sends)",
        source=Source(PAPER, "Table 1",
                      "confirmed: Table 1 as transcribed in /work/shared/TARGETS.md and "
                      "parbench.analytic.traffic.published_ubmesh_table"),
        config=config,
        method="traffic_table(UBMeshMoE2T()): parbench.analytic.comm's general traffic model "
               "(TP, CP all-gather, EP all-to-all, pipeline p2p, DP all-reduce) on the first "
               "pipeline stage",
        tolerance=0.005, cells=cells,
        notes=["Tolerance 0.5%: the shares are printed to three significant digits or "
               "fewer.",
               "The two cells outside it are the paper's printing errors, identified by "
               "compare_with_published from the rest of the printed table (their notes "
               "say how)."])


def reproduce() -> Reproduction:
    return Reproduction(
        name="ubmesh", title="UB-Mesh (arXiv 2503.20377): Table 1",
        tables=[table1()],
        intro="The per-parallelism traffic of the MoE-2T model from a configuration and the "
              "general traffic model. The measured version at small scale is "
              "results/reference/ubmesh-table1.md (`parbench run suite=traffic`).")
