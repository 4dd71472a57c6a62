"""``parbench compare``'s table for two bench_all JSON files
(:func:`parbench.report.bench_compare.compare_pairs`' diffs); the status cell and the
regression lines are compare's own (``compare_table``)."""
from __future__ import annotations

from rich.markup import escape

from .bench_compare import PairDiff
from .compare_table import _status_cell


def ratio_cell(f: dict | None) -> str:
    """'0.922× [0.696, 1.269] n=5', the error when the pair has no figure, '—' when absent."""
    if f is None:
        return "—"
    if f.get("error") or f.get("ratio") is None:
        return f"[red]no figure: {escape(f.get('error') or 'ratio not a number')}[/]"
    low, high = (f"{f[k]:.3f}" if f.get(k) is not None else "?" for k in ("low", "high"))
    text = f"{f['ratio']:.3f}× [{low}, {high}] n={f.get('repeats', '?')}"
    verdict = f.get("passed", True)
    if verdict == "finding":  # the baseline's known finding, reproduced
        return text + " [yellow](FINDING)[/]"
    return text + ("" if verdict else " [yellow](a row FAILED)[/]")


def change_cell(d: PairDiff) -> str:
    """NEW / OLD median ratio, against the ratio allowed; red when it gates, yellow when it
    is above the threshold but the repeat ranges overlap (noise), green when it fell."""
    if d.change is None:
        return "—"
    text = f"{d.change:.2f}× ({100 * (d.change - 1):+.1f}%)"
    if d.threshold is None:
        return f"{text} (ignored)"
    allowed = 1 + d.threshold
    if d.reasons:
        return f"[red]{text} > {allowed:.2f}×, ranges apart[/]"
    if d.change > allowed:
        return f"[yellow]{text} > {allowed:.2f}×, ranges overlap[/]"
    return f"[green]{text}[/]" if d.improvements else text


def table(diffs: list[PairDiff], old_name: str = "OLD", new_name: str = "NEW"):
    """The rich table: one row per pair."""
    from rich import box
    from rich.table import Table

    threshold = next((d.threshold for d in diffs), None)
    rule = ("ignore_time=true: ratios do not gate" if threshold is None else
            f"a regression: change > {1 + threshold:.2f}× and NEW's lowest repeat above "
            "OLD's highest")
    t = Table(title=f"compare {old_name} → {new_name} — {len(diffs)} bench pair(s), "
                    f"{sum(d.regression for d in diffs)} regression(s)",
              caption="ratio: median over the repeats of ours / theirs (instrument pairs: on /"
                      " off) \\[lowest, highest repeat]; change: NEW / OLD median ratio; "
                      + rule,
              box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 1), collapse_padding=True)
    for name in ("pair", "case", "old ratio \\[low, high]", "new ratio \\[low, high]",
                 "change", "verdict"):
        t.add_column(name, overflow="fold")
    for d in diffs:
        t.add_row(d.label, d.ident, ratio_cell(d.old), ratio_cell(d.new), change_cell(d),
                  _status_cell(d))
    return t
