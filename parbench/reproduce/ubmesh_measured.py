"""UB-Mesh Table 1 (arXiv 2503.20377) with a run's measurements: four figures per cell,
measured on local ranks (one rank's ledger, handed in by the ``hybrid`` scheme's figures), the hybrid's closed form at that small configuration
(``parbench.analytic.hybrid``), the traffic model at the paper's configuration
(``parbench.analytic.traffic``) and the paper's printed value, its two printing errors
flagged (``compare_with_published``).

The paper's rows are axes of the mesh: TP = ``tp``, SP (context parallelism by all-gather)
= ``cp``, EP = ``ep``, PP = ``pp``, DP = the gradient groups ``dp_cp`` and ``edp``. Within a
row, transfers are grouped by (collective, bytes per transfer); the measured groups must
equal the closed form's exactly.
"""
from __future__ import annotations

from collections import Counter

from ..analytic.shape import GiB, MiB
from ..analytic.traffic import (UBMeshMoE2T, compare_with_published, published_ubmesh_table,
                                traffic_table)

ROWS = {"TP": ("tp",), "SP": ("cp",), "EP": ("ep",), "PP": ("pp",), "DP": ("dp_cp", "edp")}
ROW_OF = {a: r for r, axes in ROWS.items() for a in axes}


def group(items) -> dict[str, Counter]:
    """(axis, op, wire bytes per transfer) items -> {row: Counter((op, wire): count)}."""
    out: dict[str, Counter] = {r: Counter() for r in ROWS}
    for axis, op, wire, count in items:
        if axis in ROW_OF and wire:
            out[ROW_OF[axis]][(op, float(wire))] += count
    return out


def measured(records: list[dict]) -> dict[str, Counter]:
    """One rank's ledger records of a step, grouped."""
    return group((r["axis"], r["op"], r["wire_bytes"], 1) for r in records)


def modelled(transfers) -> dict[str, Counter]:
    """A closed form's transfers (``analytic.comm.Transfer``), grouped."""
    return group((t.axis, t.op, t.wire_bytes, t.count) for t in transfers
                 if t.group_size > 1)


def _cell(c: Counter, unit: float, suffix: str) -> tuple[str, str, str]:
    if not c:
        return "—", "0", "0"
    per = "/".join(f"{w / unit:.4g}" for (_, w) in sorted(c))
    cnt = "/".join(str(n) for (_, _), n in sorted(c.items()))
    total = sum(w * n for (_, w), n in c.items())
    return per + suffix, cnt, f"{total / unit:.4g}{suffix}"


def _share(c: dict[str, Counter], row: str) -> str:
    tot = {r: sum(w * n for (_, w), n in v.items()) for r, v in c.items()}
    grand = sum(tot.values())
    return f"{100 * tot[row] / grand:.3g}%" if grand else "—"


def render(meas: dict[str, Counter], small: dict[str, Counter], rank: int,
           config: str) -> str:
    """The markdown table (units: KiB for the small run; the paper's MB = 2^20, GB = 2^30)."""
    paper_rows = {r.parallelism: r for r in traffic_table(UBMeshMoE2T())}
    printed = {p["parallelism"]: p for p in published_ubmesh_table()}
    flags = compare_with_published(traffic_table(UBMeshMoE2T()))
    lines = [
        "# UB-Mesh Table 1, measured and modelled",
        "",
        f"Small run: {config}; rank {rank}'s ledger for one step. Each cell: measured · "
        "closed form at the small configuration (KiB) · traffic model at the paper's "
        "configuration · the paper's printed value (MB = 2^20 B, GB = 2^30 B).",
        "",
        "| Parallelism | Pattern | Data volume per transfer | Total transfers | "
        "Total volume | Share | measured = model |",
        "|---|---|---|---|---|---|---|"]
    for row in ROWS:
        m = _cell(meas[row], 1024, " KiB")
        s = _cell(small[row], 1024, " KiB")
        pr = paper_rows[row]
        pp = ("/".join(f"{w / MiB:g}" for w in pr.per_transfer_bytes) + " MB",
              "/".join(str(n) for n in pr.counts), f"{float(pr.total_bytes) / GiB:.4g} GB",
              f"{100 * float(pr.share):.4g}%")
        pub = printed[row]
        cells = [f"{m[i]} · {s[i]} · {pp[i]} · {pub[k]}" for i, k in
                 enumerate(("per_transfer", "transfers", "total"))]
        share = f"{_share(meas, row)} · {_share(small, row)} · {pp[3]} · {pub['share']}"
        ok = "yes" if meas[row] == small[row] else "**no**"
        lines.append(f"| {row} | {pub['pattern']} | " + " | ".join(cells) +
                     f" | {share} | {ok} |")
    errors = [f for f in flags if not f.ok]
    lines += ["", "Printing errors in the paper, flagged by the model:", ""]
    lines += [f"- {f.parallelism} {f.column}: printed {f.printed}; {f.note}" for f in errors]
    return "\n".join(lines) + "\n"
