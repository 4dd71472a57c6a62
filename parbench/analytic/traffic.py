"""The per-parallelism traffic table of UB-Mesh (Liao et al. 2025, arXiv 2503.20377, Table 1),
computed from a configuration with the general model of :mod:`.comm`.

The paper lists, for the training of its in-house "MoE-2T" model, per parallelism: the
collective, the data volume per transfer, the number of transfers, the total volume and its
share. Units are binary (MB = 2^20, GB = 2^30 bytes); "per transfer" is the bytes one rank
sends by a ring algorithm (the (n-1)/n factor included), and "SP" is context parallelism with
all-gathers. :class:`UBMeshMoE2T` is a configuration under which every printed cell follows;
:func:`traffic_table` computes the table for it (or for any object with the same fields),
:func:`published_ubmesh_table` holds the printed values, and
:func:`compare_with_published` checks each cell at the printed precision and explains the two
cells that do not follow from the others: the TP total (printed 1775 GB; 360 MB x 4992 /
1024 = 1755 GB, and only 1755 gives the printed shares) and the PP share (printed 0.14%, which
is 100 minus the other printed shares; exact 0.147%).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from decimal import Decimal
from fractions import Fraction
from math import floor
from typing import Any

from . import comm
from .shape import GiB, MiB

_SRC_T5 = "sourced: UB-Mesh Table 5 (GPT4-2T-like model)"
_INF = "inferred from Table 1"


def _f(default: Any, source: str) -> Any:
    return field(default=default, metadata={"source": source})


@dataclass(frozen=True)
class UBMeshMoE2T:
    """A configuration that reproduces every cell of UB-Mesh Table 1.

    Each field's ``metadata["source"]`` says whether it is taken from the paper or inferred
    (see :func:`field_sources`). The model dimensions come from Table 5; the parallel layout,
    micro-batching, recomputation and dtype are not stated in the paper and were chosen so
    that every cell follows. The DP degree and bucket size are not identifiable from the table
    (only 2(d-1)/d x G = 711.75 MB is): d = 4 with G = 474.5 MB is one fit. Another exact fit
    for the TP/SP/EP counts is 128 layers in 2 stages with 13 micro-batches, which however
    needs a different count of pipeline transfers (both directions of a boundary).
    """

    hidden_size: int = _f(12288, _SRC_T5)
    num_layers: int = _f(96, _SRC_T5)
    num_heads: int = _f(96, _SRC_T5 + "; head size 128")
    num_experts: int = _f(16, _SRC_T5)
    bytes_per_element: int = _f(2, _INF + ": bf16")
    micro_batch_size: int = _f(1, _INF)
    tokens_per_rank: int = _f(8192, _INF + ": sequence chunk per CP rank per micro-batch, "
                              "A = b s h x 2 B = 192 MB")
    pp: int = _f(3, _INF + ": 3 stages of 32 layers")
    num_microbatches: int = _f(26, _INF + ": PP transfers 26 = m sends of the first stage")
    tp: int = _f(16, _INF + ": 2 x 15/16 x A = 360 MB")
    recompute: bool = _f(True, _INF + ": 6 TP all-reduces and 6 EP all-to-alls per layer "
                         "per micro-batch (forward, recompute, backward)")
    cp: int = _f(16, _INF + ": 15/16 x A = 180 MB; gathered K = b (s cp)(h/t) x 2 B = A")
    cp_gathers: tuple = _f(((1, 6), (2, 2)), _INF + ": K, V gathered separately 6 times "
                           "(forward, recompute, backward) and as one K||V message twice")
    ep: int = _f(8, _INF + ": 7/8 x 512 x 12288 x 2 B = 10.5 MB")
    moe_top_k: int = _f(1, _INF)
    dp: int = _f(4, _INF + ": not identifiable, only 2(d-1)/d x G is")
    dp_bucket_bytes: int = _f(949 * MiB // 2, _INF + ": G = 474.5 MB with d = 4")
    dp_buckets_per_layer: int = _f(2, _INF + ": 64 all-reduces = 2 per layer of a stage")

    @property
    def layers_per_stage(self) -> int:
        if self.num_layers % self.pp:
            raise ValueError(f"pp={self.pp} does not divide num_layers={self.num_layers}")
        return self.num_layers // self.pp


#: Named configurations for ``parbench traffic preset=NAME``.
TRAFFIC_PRESETS = {"ubmesh-moe-2t": UBMeshMoE2T}


def field_sources(cfg: Any = UBMeshMoE2T) -> dict[str, str]:
    """Field name -> where its value comes from."""
    return {f.name: f.metadata.get("source", "") for f in fields(cfg)}


# ---------------------------------------------------------------------------------------
# the table
# ---------------------------------------------------------------------------------------

PATTERN_NAMES = {"all_reduce": "AllReduce", "all_gather": "AllGather",
                 "reduce_scatter": "ReduceScatter", "all_to_all": "AlltoAll", "send": "P2P"}


@dataclass(frozen=True)
class TrafficRow:
    """One parallelism: per-transfer wire bytes and counts (one entry per distinct size),
    total wire bytes and share of the table's total (a fraction in [0, 1])."""

    parallelism: str
    pattern: str
    per_transfer_bytes: tuple
    counts: tuple
    total_bytes: Fraction
    share: Fraction

    def as_dict(self) -> dict:
        return {"parallelism": self.parallelism, "pattern": self.pattern,
                "per_transfer_MiB": [float(Fraction(x) / MiB) for x in self.per_transfer_bytes],
                "transfers": list(self.counts),
                "total_GiB": float(self.total_bytes / GiB),
                "share_percent": float(self.share * 100)}


def ubmesh_transfers(cfg: Any) -> dict[str, list[comm.Transfer]]:
    """One rank's transfers per parallelism for one iteration of ``cfg`` (first pipeline
    stage; every layer is an MoE layer; the EP tokens are the sequence-parallel shard
    tokens_per_rank / tp of the micro-batch)."""
    b, s, h, e = cfg.micro_batch_size, cfg.tokens_per_rank, cfg.hidden_size, cfg.bytes_per_element
    layers, m = cfg.layers_per_stage, cfg.num_microbatches
    if (b * s) % cfg.tp:
        raise ValueError(f"tp={cfg.tp} does not divide the {b * s} tokens per rank")
    buckets = cfg.dp_buckets_per_layer * layers
    return {
        "TP": comm.tp_traffic(b, s, h, cfg.tp, layers, m, e, recompute=cfg.recompute),
        "SP": comm.cp_allgather_traffic(b, s, h, cfg.cp, cfg.tp, layers, m, e,
                                        gathers=cfg.cp_gathers),
        "EP": comm.expert_traffic(b * s // cfg.tp, h, cfg.ep, layers, m, cfg.moe_top_k, e,
                                  recompute=cfg.recompute),
        "PP": comm.pipeline_p2p_traffic(b, s, h, cfg.pp, m, rank=0, bytes_per_element=e),
        "DP": comm.ddp_traffic(cfg.dp_bucket_bytes * buckets, cfg.dp, buckets),
    }


def traffic_table(cfg: Any = None) -> list[TrafficRow]:
    """The UB-Mesh-style table for ``cfg`` (default :class:`UBMeshMoE2T`)."""
    cfg = UBMeshMoE2T() if cfg is None else cfg
    per_axis = ubmesh_transfers(cfg)
    partial = []
    for name, transfers in per_axis.items():
        sizes: dict[Fraction, int] = {}
        for tr in transfers:
            w = Fraction(tr.wire_bytes)
            sizes[w] = sizes.get(w, 0) + tr.count
        ops = {PATTERN_NAMES[tr.op] for tr in transfers}
        total = sum((w * c for w, c in sizes.items()), Fraction(0))
        partial.append((name, "/".join(sorted(ops)), tuple(sizes), tuple(sizes.values()), total))
    grand = sum(p[4] for p in partial) or Fraction(1)
    return [TrafficRow(n, pat, tuple(comm.as_number(w) for w in ws), cs, tot, tot / grand)
            for n, pat, ws, cs, tot in partial]


# ---------------------------------------------------------------------------------------
# the printed table and the cell-by-cell comparison
# ---------------------------------------------------------------------------------------

def published_ubmesh_table() -> list[dict[str, str]]:
    """UB-Mesh (arXiv 2503.20377) Table 1 as printed (MB = 2^20, GB = 2^30 bytes)."""
    return [
        {"parallelism": "TP", "pattern": "AllReduce", "per_transfer": "360 MB",
         "transfers": "4992", "total": "1775 GB", "share": "52.9%"},
        {"parallelism": "SP", "pattern": "AllGather", "per_transfer": "180/360 MB",
         "transfers": "4992/1664", "total": "1462.5 GB", "share": "44.08%"},
        {"parallelism": "EP", "pattern": "AlltoAll", "per_transfer": "10.5 MB",
         "transfers": "4992", "total": "51.19 GB", "share": "1.54%"},
        {"parallelism": "PP", "pattern": "P2P", "per_transfer": "192 MB",
         "transfers": "26", "total": "4.875 GB", "share": "0.14%"},
        {"parallelism": "DP", "pattern": "AllReduce", "per_transfer": "711.75 MB",
         "transfers": "64", "total": "44.48 GB", "share": "1.34%"},
    ]


@dataclass(frozen=True)
class CellCheck:
    parallelism: str
    column: str
    printed: str
    computed: str
    ok: bool
    note: str = ""


def _printed_numbers(text: str) -> list[str]:
    return text.replace("MB", "").replace("GB", "").replace("%", "").strip().split("/")


def _decimals(num: str) -> int:
    return len(num.split(".")[1]) if "." in num else 0


def round_half_up(x: Fraction, decimals: int) -> Decimal:
    """``x`` rounded half-up to ``decimals`` places, exactly."""
    q = floor(x * 10 ** decimals + Fraction(1, 2))
    return Decimal(q).scaleb(-decimals)


def _as_printed(values: list[Fraction], printed: str) -> str:
    nums = _printed_numbers(printed)
    if len(nums) != len(values):
        return "/".join(str(float(v)) for v in values)
    return "/".join(str(round_half_up(v, _decimals(p))) for v, p in zip(values, nums))


def compare_with_published(rows: list[TrafficRow],
                           published: list[dict[str, str]] | None = None) -> list[CellCheck]:
    """Compare every numeric cell of ``rows`` with the printed table at the printed
    precision (half-up rounding). A mismatching cell gets a note explaining it when it is a
    printing error that the rest of the printed table exposes:

    - a total inconsistent with its own printed per-transfer x transfers / 1024 whose printed
      share is reproduced only by the computed total;
    - a share that equals 100 minus the other printed shares.
    """
    published = published_ubmesh_table() if published is None else published
    by_name = {r.parallelism: r for r in rows}
    printed_shares = {p["parallelism"]: Decimal(_printed_numbers(p["share"])[0])
                      for p in published}
    grand = sum((r.total_bytes for r in rows), Fraction(0))
    out = []
    for pub in published:
        name = pub["parallelism"]
        row = by_name.get(name)
        if row is None:
            out.append(CellCheck(name, "row", name, "", False, "no computed row"))
            continue
        cells = {
            "pattern": (None, row.pattern),
            "per_transfer": ([Fraction(w) / MiB for w in row.per_transfer_bytes], None),
            "transfers": ([Fraction(c) for c in row.counts], None),
            "total": ([row.total_bytes / GiB], None),
            "share": ([row.share * 100], None),
        }
        for col, (values, text) in cells.items():
            printed = pub[col]
            computed = text if values is None else _as_printed(values, printed)
            ok = computed == printed if values is None else \
                computed == "/".join(_printed_numbers(printed))
            note = "" if ok else _explain(col, pub, row, rows, grand, printed_shares)
            out.append(CellCheck(name, col, printed, computed, ok, note))
    return out


def _explain(col: str, pub: dict, row: TrafficRow, rows: list[TrafficRow], grand: Fraction,
             printed_shares: dict[str, Decimal]) -> str:
    name = pub["parallelism"]
    if col == "share":
        others = sum(v for k, v in printed_shares.items() if k != name)
        exact = round_half_up(row.share * 100, 3)
        if Decimal(100) - others == printed_shares[name]:
            return (f"printing error: printed as 100% minus the other printed shares "
                    f"({Decimal(100) - others}%); exact {exact}%")
        return f"exact {exact}%"
    if col == "total":
        per = [Fraction(Decimal(x)) for x in _printed_numbers(pub["per_transfer"])]
        cnt = [int(x) for x in _printed_numbers(pub["transfers"])]
        implied = sum((p * c for p, c in zip(per, cnt)), Fraction(0)) / 1024
        printed_total = Fraction(Decimal(_printed_numbers(pub["total"])[0]))
        if implied != printed_total:
            d = _decimals(_printed_numbers(pub["share"])[0])
            alt_share = printed_total * GiB / (grand - row.total_bytes + printed_total * GiB)
            ours = round_half_up(row.share * 100, d) == printed_shares[name]
            theirs = round_half_up(alt_share * 100, d) == printed_shares[name]
            verdict = (f"; only {float(implied):g} GB reproduces the printed share "
                       f"{printed_shares[name]}% ({float(printed_total):g} GB would give "
                       f"{round_half_up(alt_share * 100, d)}%)") if ours and not theirs else ""
            return (f"printing error: printed per-transfer x transfers / 1024 = "
                    f"{float(implied):g} GB, not {float(printed_total):g} GB{verdict}")
    return ""
