"""Rendering results: rich tables per family, a markdown report and figures.

Units: byte figures use binary prefixes (KiB = 2^10, MiB = 2^20, GiB = 2^30). A measured
figure equal to its prediction is shown once with "=", otherwise both are shown.
"""
from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table


def fmt_bytes(n) -> str:
    if n is None:
        return "—"
    n = float(n)
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= div:
            return f"{n / div:.4g} {unit}"
    return f"{n:.0f} B"


def fmt_sci(x) -> str:
    return "—" if x is None else f"{x:.1e}"


def _degrees(row: dict) -> str:
    d = row.get("degrees", {})
    parts = [f"{a}{d[a]}" for a in ("tp", "cp", "ep", "dp", "pp") if d.get(a, 1) > 1]
    if d.get("vpp", 1) > 1:
        parts.append(f"v{d['vpp']}")
    return " ".join(parts) or "1"


def _same_case(a: dict, b: dict) -> bool:
    ca, cb = dict(a["case"]), dict(b["case"])
    ra, rb = dict(ca["run"]), dict(cb["run"])
    ra.pop("scheme"), rb.pop("scheme")
    return ca["model"] == cb["model"] and ca["parallel"] == cb["parallel"] and ra == rb


def baseline_ratios(rows: list[dict]) -> dict[str, list[tuple[str, float]]]:
    """For each native row id: [(baseline scheme, our step time / baseline step time)]."""
    out: dict[str, list] = {}
    for b in rows:
        native = b.get("baseline_of")
        if not native or not b.get("step_time_s"):
            continue
        for r in rows:
            if r["scheme"] == native and r.get("step_time_s") and _same_case(r, b):
                out.setdefault(r["id"], []).append((b["scheme"], r["step_time_s"] /
                                                    b["step_time_s"]))
    return out


def _vs(measured, predicted, exact: bool | None = None) -> str:
    """'x =' when measured equals predicted (on every rank, if ``exact`` says so)."""
    if predicted is None:
        return fmt_bytes(measured)
    if exact is None:
        exact = measured is not None and abs(float(measured) - float(predicted)) < 0.5
    if exact:
        return f"{fmt_bytes(measured)} ="
    return f"{fmt_bytes(measured)} / {fmt_bytes(predicted)}"


def _states(row: dict) -> str:
    meas = (row.get("model_state_bytes") or [None])[0]
    pred = row.get("model_state_bytes_predicted")
    if not meas:
        return "—"
    m = sum(meas.values())
    if not pred:
        return fmt_bytes(m)
    return _vs(m, sum(pred.get(k, 0) for k in meas), row.get("model_state_exact"))


def _wire(row: dict) -> str:
    """Per axis: measured (= predicted), then the calls actually made, e.g. all_reduce×7."""
    meas = row.get("wire_bytes") or {}
    pred = row.get("wire_bytes_predicted") or {}
    axes = sorted(set(meas) | set(k for k, v in pred.items() if v))
    if not axes:
        return "—"
    calls: dict[str, list[str]] = {}
    for key, e in (row.get("ledger_summary") or {}).items():
        axis, op = key.split("/", 1)
        if e["wire_bytes"] or op not in ("recv", "barrier"):
            calls.setdefault(axis, []).append(f"{op}×{e['count']}")
    exact = row.get("wire_exact")
    return "\n".join(f"{a} {_vs(meas.get(a, 0.0), pred.get(a), exact if a in pred else None)}"
                     + (f"\n  {' '.join(calls[a])}" if a in calls else "") for a in axes)


def _paper_states(row: dict) -> str | None:
    """The ZeRO paper's mixed-precision accounting (2+2+K, K=12) for this rank, if given."""
    paper = (row.get("prediction") or {}).get("paper") or {}
    mixed = (paper.get("model_state_bytes") or {}).get("mixed_adam")
    return fmt_bytes(mixed["total"]) if mixed else None


#: pipeline bubble ratios, folded into one column in this order
BUBBLE_KEYS = ("bubble_measured", "bubble_replayed", "bubble_sim_mean_costs", "bubble_unit",
               "bubble_closed_form")
BUBBLE_COLUMN = "bubble: measured / replayed /\nsim (mean costs) / unit / closed form"


def _peaks(row: dict) -> str:
    """Largest peak per rank; every rank's when they differ by more than 5% (pipeline
    stages), in rank order."""
    peaks = [p for p in row.get("peak_bytes") or [] if p is not None]
    if not peaks:
        return "—"
    if max(peaks) > 1.05 * min(peaks):
        return "\n".join(f"r{i} {fmt_bytes(p)}" for i, p in enumerate(peaks))
    pred = row.get("peak_bytes_predicted")
    if pred:
        return f"{fmt_bytes(max(peaks))}\nanalytic {fmt_bytes(pred)}"
    return fmt_bytes(max(peaks))


def _extra_keys(rows: list[dict]) -> list[str]:
    keys: list[str] = []
    for r in rows:
        for k, v in (r.get("extra") or {}).items():
            if k in BUBBLE_KEYS:
                k = BUBBLE_COLUMN
            if k not in keys and (v is None or isinstance(v, (int, float, str))):
                keys.append(k)
    return keys


def _extra_value(row: dict, key: str) -> str:
    extra = row.get("extra") or {}
    if key == BUBBLE_COLUMN:
        vals = [extra.get(k) for k in BUBBLE_KEYS]
        if all(v is None for v in vals):
            return "—"
        return " / ".join("—" if v is None else f"{100 * v:.1f}%" for v in vals)
    return _fmt_extra(extra.get(key))


def _uniform_tolerance(rows: list[dict]) -> dict | None:
    tols = {tuple(sorted((r.get("tolerance") or {}).items())) for r in rows}
    return dict(next(iter(tols))) if len(tols) == 1 else None


def _fmt_extra(v) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def tables(rows: list[dict]) -> list[Table]:
    ratios = baseline_ratios(rows)
    fams: dict[str, list[dict]] = {}
    for r in rows:
        fams.setdefault(r.get("family", "?"), []).append(r)
    out = []
    for fam, frows in fams.items():
        uniform = _uniform_tolerance(frows)
        caption = ("bytes per rank per step, largest rank; 'x =' means every rank equals its "
                   "prediction; KiB = 2^10 B, MiB = 2^20 B")
        if uniform:
            caption += (f"; tolerance rtol {uniform.get('rtol', 0):.0e}, atol "
                        f"{uniform.get('atol', 0):.0e}, params {uniform.get('param_atol', 0):.0e}"
                        " (tensor-wise)")
        shared = [r for r in frows if r.get("host_cpus") and r["world_size"] > r["host_cpus"]]
        if shared:
            caption += (f"; {len(shared)} case(s) ran more ranks than the host's "
                        f"{shared[0]['host_cpus']} cores (marked *): their wall-clock times and "
                        "measured bubbles include core sharing")
        t = Table(title=f"{fam} — {len(frows)} case(s)", caption=caption, show_lines=True)
        cols = ["scheme", "degrees", "golden", "max |Δ| loss/grad/param", "tolerance",
                "step ms", "tok/s", "peak/rank", "model states", "wire bytes", "ours / baseline"]
        if uniform:
            cols.remove("tolerance")
        for col in cols:
            t.add_column(col, overflow="fold")
        extra = _extra_keys(frows)
        paper = any(_paper_states(r) for r in frows)
        if paper:
            t.add_column("ZeRO paper 2+2+K", overflow="fold")
        for k in extra:
            t.add_column(k, overflow="fold")
        for r in frows:
            tol = r.get("tolerance", {})
            rat = ratios.get(r["id"], [])
            rat_s = "\n".join(f"{v:.2f}× {b.replace('baseline.', '')}" for b, v in rat) or "—"
            tol_cell = [] if uniform else [
                f"rtol {tol.get('rtol', 0):.0e}\natol {tol.get('atol', 0):.0e}\n"
                f"param {tol.get('param_atol', 0):.0e}"]
            star = "*" if r in shared else ""
            t.add_row(
                r["scheme"], _degrees(r) + star,
                "[green]pass[/]" if r["equivalent"] else "[red]FAIL[/]",
                "\n".join(fmt_sci(r.get(k)) for k in ("max_loss_abs", "max_grad_abs",
                                                      "max_param_abs")),
                *tol_cell,
                f"{r['step_time_s'] * 1e3:.2f}" if r.get("step_time_s") else "—",
                f"{r['tokens_per_s']:.0f}" if r.get("tokens_per_s") else "—",
                _peaks(r), _states(r), _wire(r), rat_s,
                *([_paper_states(r) or "—"] if paper else []),
                *[_extra_value(r, k) for k in extra])
        out.append(t)
    return out


def print_tables(rows: list[dict], console: Console | None = None) -> None:
    if console is None:
        import shutil
        console = Console(width=max(shutil.get_terminal_size((160, 40)).columns, 200))
    for t in tables(rows):
        console.print(t)


def markdown(rows: list[dict]) -> str:
    ratios = baseline_ratios(rows)
    lines = ["# parbench results", "",
             "Bytes per rank per step; KiB = 2^10, MiB = 2^20 bytes. 'x =' means measured equals "
             "the analytic prediction exactly.", "",
             "| scheme | degrees | equivalent | max abs dloss | max abs dparam | step ms | "
             "peak/rank | model states | wire bytes | ours / baseline |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        peaks = [p for p in r.get("peak_bytes") or [] if p is not None]
        rat = "; ".join(f"{v:.2f}x {b}" for b, v in ratios.get(r["id"], [])) or "-"
        lines.append("| " + " | ".join([
            r["scheme"], _degrees(r), "pass" if r["equivalent"] else "FAIL",
            fmt_sci(r.get("max_loss_abs")), fmt_sci(r.get("max_param_abs")),
            f"{r['step_time_s'] * 1e3:.2f}" if r.get("step_time_s") else "-",
            fmt_bytes(max(peaks)) if peaks else "-", _states(r),
            _wire(r).replace("\n", "; "), rat]) + " |")
    return "\n".join(lines) + "\n"


def figures(rows: list[dict], out_dir: Path) -> list[Path]:
    """Step time per case and wire bytes measured vs predicted, as PNGs."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    timed = [r for r in rows if r.get("step_time_s")]
    if timed:
        fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(timed) + 2), 4))
        labels = [f"{r['scheme']}\n{_degrees(r)}" for r in timed]
        ax.bar(range(len(timed)), [r["step_time_s"] * 1e3 for r in timed],
               color=["#4C72B0" if not r.get("baseline_of") else "#999999" for r in timed])
        ax.set_xticks(range(len(timed)), labels, rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("median step time (ms)")
        ax.set_title("Step time (grey: baselines)")
        fig.tight_layout()
        p = out_dir / "step_time.png"
        fig.savefig(p, dpi=120)
        plt.close(fig)
        paths.append(p)
    wired = [r for r in rows if r.get("wire_bytes")]
    if wired:
        fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(wired) + 2), 4))
        meas = [sum((r.get("wire_bytes") or {}).values()) for r in wired]
        pred = [sum(v for v in (r.get("wire_bytes_predicted") or {}).values() if v) for r in wired]
        xs = range(len(wired))
        ax.bar([x - 0.2 for x in xs], [m / 2**10 for m in meas], 0.4, label="measured")
        ax.bar([x + 0.2 for x in xs], [p / 2**10 for p in pred], 0.4, label="predicted")
        ax.set_xticks(list(xs), [f"{r['scheme']}\n{_degrees(r)}" for r in wired], rotation=60,
                      ha="right", fontsize=7)
        ax.set_ylabel("wire bytes per rank per step (KiB)")
        ax.legend()
        fig.tight_layout()
        p = out_dir / "wire_bytes.png"
        fig.savefig(p, dpi=120)
        plt.close(fig)
        paths.append(p)
    return paths


def write_report(rows: list[dict], out_dir: Path) -> list[Path]:
    out_dir = Path(out_dir)
    md = out_dir / "report.md"
    md.write_text(markdown(rows))
    return [md, *figures(rows, out_dir / "figures")]
