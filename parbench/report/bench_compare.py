"""Two ``scripts/bench_all.py --json`` files, pair by pair: what ``parbench compare OLD NEW``
decides when both are bench_all's JSON (issue 24).

Such a file is a JSON list of :class:`parbench.bench_pairs.PairResult` objects: per pair
(``kind`` "baseline": ours / a framework's, "instrument": instruments on / off) the median
over the repeats of the two runs' step-time ratio (``ratio``) and the lowest and highest
repeat's ratio (``low``, ``high``), or ``error`` when the pair has no figure. Pure functions
but :func:`read_pairs` (reading a file); ``cli/compare.py`` detects the format and prints.

Pairs are matched by (kind, label, case). Two pairs of one file can share that key (the case
text names model, layout, dtype and suites only: a suite may hold a baseline twice with other
fields): when every pair of both files carries bench_all's ``key`` (a hash of the cases'
fields) it is part of the match; else the n-th pair of a key in OLD is matched with the n-th
in NEW, in the file's order (bench_all's order: suites, then their cases).

What is a regression (``PairDiff.regression``):

- a pair of OLD with none in NEW ("missing"); a pair only in NEW is "new", not a regression;
- a pair with a figure in OLD and none in NEW (NEW's ``error``, or a ratio that is not a
  finite number); the other way round is an improvement;
- the ratio regressed: NEW's median ratio exceeds OLD's by more than the threshold,
  ``ratio_new / ratio_old > 1 + threshold``, AND the two runs' repeat ranges do not overlap,
  ``low_new > high_old``. A shared 2-core machine moves single repeats by tens of percent
  (pipeline pairs spread over [0.5, 2.5] in one run), so a median alone would trip the gate
  on noise; disjoint ranges say every repeat of NEW was slower than every repeat of OLD.
  The threshold is compare's ``time_tol`` when a number is given, else compare's
  ``TIME_FLOOR`` (there is no per-step noise to estimate from here: the repeats' range
  stands for it); ``ignore_time=true`` leaves ratios ungated. A fall by more than the
  threshold with disjoint ranges (``high_new < low_old``) is an improvement.

A pair's own verdict (``passed``: every row of its runs passed) is shown, not gated: the
results rows' gate is ``parbench compare`` on two results directories. compare's options
for rows (``bytes_tol``, ``match``, ``gate_baselines``) are bad input here.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from ..config import ConfigError
from .compare import TIME_FLOOR, Options

#: the fields of a PairResult a comparison reads, and those it must find
FIGURES = ("ratio", "low", "high", "repeats", "passed", "cpu_ratio", "error")
REQUIRED = ("label", "kind", "case", "ratio", "low", "high")


# ---- reading -----------------------------------------------------------------------------


def is_bench_file(path: str | Path) -> bool:
    """Whether ``path`` is a file whose JSON is a list (bench_all's format); a results
    ``.jsonl`` holds one object per line, a results directory is a directory."""
    p = Path(path)
    if not p.is_file():
        return False
    try:
        with p.open(encoding="utf-8") as f:
            head = f.read(4096).lstrip()
    except (OSError, UnicodeDecodeError):
        return False
    return head.startswith("[")


def read_pairs(path: str | Path, what: str = "path") -> list[dict]:
    """The pairs of a bench_all JSON file; ConfigError naming the file when it cannot be read,
    is not JSON, holds no pairs, or an entry is not a pair."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{what}={path} cannot be read ({type(e).__name__}: "
                          f"{getattr(e, 'strerror', None) or e})") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{what}={path} is not JSON ({e})") from None
    if not isinstance(data, list) or not data:
        raise ConfigError(f"{what}={path} has no pairs (bench_all's --json writes a list of "
                          "pairs)")
    for i, p in enumerate(data, start=1):
        _check_pair(p, i, f"{what}={path}")
    return data


def _check_pair(p, i: int, where: str) -> None:
    """A ConfigError naming the entry and the field when ``p`` is not a PairResult dict."""
    if not isinstance(p, dict):
        raise ConfigError(f"{where}: entry {i} is not a bench_all pair (not an object)")
    for k in REQUIRED:
        if k not in p:
            raise ConfigError(f"{where}: entry {i} is not a bench_all pair (no {k!r})")
    for k in ("label", "kind", "case"):
        if not isinstance(p[k], str):
            raise ConfigError(f"{where}: entry {i}: {k}={p[k]!r} must be a string")
    for k in ("ratio", "low", "high"):
        v = p[k]
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise ConfigError(f"{where}: entry {i}: {k}={v!r} must be a number")
    if not isinstance(p.get("error", ""), str):
        raise ConfigError(f"{where}: entry {i}: error={p['error']!r} must be a string")


# ---- matching ----------------------------------------------------------------------------


def keyed(pairs: list[dict], by_key: bool = False) -> dict[tuple, dict]:
    """(kind, label, case, n) -> pair, n counting the pairs of one (kind, label, case) in the
    file's order from 1; ``by_key``: (kind, label, case, the pair's ``key``) -- the hash of
    its cases' fields that bench_all writes, which tells repeated cases apart in any order."""
    if by_key:
        return {(p["kind"], p["label"], p["case"], p["key"]): p for p in pairs}
    out: dict[tuple, dict] = {}
    seen: dict[tuple, int] = {}
    for p in pairs:
        k = (p["kind"], p["label"], p["case"])
        seen[k] = seen.get(k, 0) + 1
        out[(*k, seen[k])] = p
    return out


def match_pairs(old: list[dict], new: list[dict]) -> list[tuple[tuple, dict | None,
                                                              dict | None]]:
    """(key, OLD's pair or None, NEW's pair or None), OLD's order first, then NEW's new pairs;
    ConfigError when no pair is in both (two files of other suites)."""
    by_key = all(p.get("key") for p in old + new)
    a, b = keyed(old, by_key), keyed(new, by_key)
    if not set(a) & set(b):
        raise ConfigError("OLD and NEW have no bench pair in common (matched by kind, label "
                          "and case)")
    keys = list(a) + [k for k in b if k not in a]
    return [(k, a.get(k), b.get(k)) for k in keys]


# ---- one pair, classified ----------------------------------------------------------------


def has_figure(p: dict) -> bool:
    """No error, and a finite ratio and range."""
    return not p.get("error") and all(
        isinstance(p.get(k), (int, float)) and math.isfinite(p[k])
        for k in ("ratio", "low", "high"))


def threshold_of(opts: Options) -> float | None:
    """The relative rise of the median ratio tolerated (module docstring); None with
    ``ignore_time``. ConfigError for compare's options that apply to results rows only."""
    rows_only = [f"{k}={v}" for k, v, default in (
        ("bytes_tol", opts.bytes_tol, 0.0), ("match", opts.match, "id"),
        ("gate_baselines", opts.gate_baselines, False)) if v != default]
    if rows_only:
        raise ConfigError(f"compare's options for results rows ({', '.join(rows_only)}) do not "
                          "apply to bench_all pairs (use time_tol= or ignore_time=)")
    if opts.ignore_time:
        return None
    return TIME_FLOOR if opts.time_tol is None else opts.time_tol


def _figures(p: dict | None) -> dict | None:
    if p is None:
        return None
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in ((k, p.get(k)) for k in FIGURES)}


@dataclass
class PairDiff:
    """One pair of the comparison. ``status``: ok | regression | missing | new. ``old``,
    ``new``: the pair's figures in each file (``FIGURES``; None: not in that file)."""

    kind: str
    label: str
    case: str
    n: int = 1
    status: str = "ok"
    old: dict | None = None
    new: dict | None = None
    #: NEW's median ratio / OLD's (None: a side has no figure)
    change: float | None = None
    threshold: float | None = None
    #: the repeat ranges [low, high] of the two runs overlap (None: not both measured)
    overlap: bool | None = None
    reasons: list[str] = field(default_factory=list)
    improvements: list[str] = field(default_factory=list)

    @property
    def ident(self) -> str:
        if isinstance(self.n, str):  # matched by bench_all's key: its last hex digits
            return f"{self.case} #{self.n[-6:]}"
        return self.case if self.n == 1 else f"{self.case} #{self.n}"

    @property
    def old_id(self) -> str | None:
        return self.ident if self.old is not None else None

    @property
    def new_id(self) -> str | None:
        return self.ident if self.new is not None else None

    @property
    def regression(self) -> bool:
        return self.status in ("regression", "missing")

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in (
            "kind", "label", "case", "n", "status", "old", "new", "change", "threshold",
            "overlap", "reasons", "improvements", "regression")}

    @property
    def findings(self) -> list[str]:
        """None: every figure of a pair gates (compare's ``Diff.findings`` are a baseline's
        ungated figures); for the status cell both tables share."""
        return []


def _ratio_change(d: PairDiff, old: dict, new: dict) -> None:
    """The ratio's rule (module docstring): a regression, an improvement, or neither."""
    d.change = new["ratio"] / old["ratio"] if old["ratio"] else None
    d.overlap = not (new["low"] > old["high"] or new["high"] < old["low"])
    if d.change is None or d.threshold is None:
        return
    allowed = 1 + d.threshold

    def text(bound: str) -> str:
        return (f"ratio: {old['ratio']:.3f}× → {new['ratio']:.3f}× ({d.change:.2f}×{bound}; "
                f"[{old['low']:.3f}, {old['high']:.3f}] → "
                f"[{new['low']:.3f}, {new['high']:.3f}])")

    if d.change > allowed and new["low"] > old["high"]:
        d.reasons.append(text(f" > {allowed:.2f}×"))
    elif d.change < 1 / allowed and new["high"] < old["low"]:
        d.improvements.append(text(""))


def diff_pair(key: tuple, old: dict | None, new: dict | None,
              threshold: float | None = TIME_FLOOR) -> PairDiff:
    """Measure and classify one matched pair (either side may be None)."""
    kind, label, case, n = key
    d = PairDiff(kind, label, case, n, old=_figures(old), new=_figures(new),
                 threshold=threshold)
    if old is None:
        d.status = "new"
        return d
    if new is None:
        d.status = "missing"
        d.reasons.append("missing: in OLD, not in NEW")
        return d
    fo, fn = has_figure(old), has_figure(new)
    if fo and not fn:
        d.reasons.append(f"no figure: {new.get('error') or 'the ratio is not a number'}")
    elif fn and not fo:
        d.improvements.append("figure: none in OLD")
    elif fo and fn:
        _ratio_change(d, old, new)
    if d.reasons:
        d.status = "regression"
    return d


def compare_pairs(old: list[dict], new: list[dict], opts: Options | None = None
                  ) -> list[PairDiff]:
    """Every pair of either file, matched and classified."""
    threshold = threshold_of(opts or Options())
    return [diff_pair(k, o, n, threshold) for k, o, n in match_pairs(old, new)]
