"""Two runs, case by case: what ``parbench compare OLD NEW`` decides (the CI gate).

Pure functions over rows, no I/O but ``read_rows``: ``match_rows`` pairs the rows of two
runs by a case key, ``diff_rows`` measures one pair and classifies it, ``compare_rows`` does
both for whole runs, ``table`` renders them. ``cli/compare.py`` parses options and prints.

What is a regression (``Diff.regression``):

- a case of OLD with no row in NEW ("missing"); a case only in NEW is "new", not a regression;
- the verdict got worse, in the order pass > inexact (equivalent, but a native scheme's bytes,
  calls or model states left their closed form) > FAIL (not equivalent) > crashed / hung;
- on any mesh axis, the largest rank's wire bytes or byte-carrying calls per step (the last
  checked step, as in the row) went up, or on any rank the model-state or peak bytes went up,
  by more than ``bytes_tol`` (relative; default 0: a native scheme's figures are
  deterministic, so any increase of a byte or a call counts);
- the step time ratio NEW / OLD exceeds 1 + threshold. The threshold is ``time_tol`` when it
  is a number, else (``time_tol=auto``) the noise of the repeated steps of both runs:

      s = 1.4826 * median_{rank r, timed step j} |t_rj / median_j(t_rj) - 1|   (each run)
      threshold = max(TIME_FLOOR, TIME_K * sqrt(s_old^2 + s_new^2))

  ``s`` is the robust (MAD-based) relative standard deviation of one step's time, pooled over
  the ranks after dividing out each rank's own median (so a rank that is slower by design, a
  pipeline stage, adds no noise); sqrt(s_old^2 + s_new^2) is that of the ratio of two steps.
  TIME_K = 3 and TIME_FLOOR = 0.10 (asv's default factor, 1.1). A run that kept fewer than 2
  timed steps on every rank (``timed_steps - warmup_steps < 2``, or a file written before
  the timed steps were kept) has no noise estimate: with ``time_tol=auto`` its time gets no
  verdict ("no repeated steps").

  The threshold does not shrink with more timed steps: it bounds the noise of one step, and
  run-to-run drift of a shared machine (load, clocks, placement) does not average out within
  a run. Nor does the threshold see that drift: where runs move more than their steps do,
  give ``time_tol=`` or ``ignore_time=true``.

For a baseline (``baseline_of`` set) only the verdict and a missing row gate: a rise in its
bytes, memory or time is a finding (``Diff.findings``), shown, as in ``run``'s verdict --
torch's FSDP2 peak on CPU moved by 6% between two runs of the smoke suite.
``gate_baselines`` gates them like a native scheme's.
"""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass, field

from ..config import ConfigError
from ..results import Row
from . import cells
from .result_files import read_rows, results_path  # noqa: F401  (re-exported)

#: the auto threshold: TIME_K robust standard deviations of the ratio, at least TIME_FLOOR
TIME_K = 3.0
TIME_FLOOR = 0.10
#: MAD -> standard deviation for normally distributed samples
MAD_SIGMA = 1.4826
#: bytes are compared with this absolute slack (wire bytes are floats: ring formulas)
BYTES_SLACK = 0.5

#: verdicts from best to worst; a failed row's verdict is its failure kind, upper case
VERDICT_ORDER = {"pass": 3, "inexact": 2, "FAIL": 1}
MATCHES = ("id", "config")


@dataclass
class Options:
    """``bytes_tol``: relative increase of bytes and calls tolerated (0: none). ``time_tol``:
    a fixed relative threshold on the step time ratio, or None for the automatic one.
    ``ignore_time``: no time verdict at all. ``match``: ``id`` (the row's id, a digest of
    the whole case configuration, scheme included) or ``config`` (the case configuration
    without the scheme's name: the same case run by another scheme). ``gate_baselines``: a
    baseline's bytes, memory and time gate too (by default they are findings; its verdict
    gates)."""

    bytes_tol: float = 0.0
    time_tol: float | None = None
    ignore_time: bool = False
    match: str = "id"
    gate_baselines: bool = False


@dataclass
class TimeDiff:
    old_s: float | None = None
    new_s: float | None = None
    ratio: float | None = None
    threshold: float | None = None
    #: "auto" (from the repeated steps), "fixed" (time_tol=), or None (no verdict)
    source: str | None = None
    #: the relative standard deviation of one step, per run (auto only)
    spread_old: float | None = None
    spread_new: float | None = None
    #: why there is no verdict ("no repeated steps", "no timed steps", "ignored")
    note: str = ""


@dataclass
class Diff:
    """One case of the comparison. ``status``: ok | regression | missing | new."""

    key: str
    label: str
    old_id: str | None
    new_id: str | None
    status: str = "ok"
    #: its bytes, memory and time gate (False: a baseline's, unless ``gate_baselines``)
    gated: bool = True
    #: "what: how much", what being verdict, missing, time, or a figure and its axis or rank
    #: ("wire dp: +4 B (+0.003%)", "peak r1: +852 B (+0.1%)")
    reasons: list[str] = field(default_factory=list)
    improvements: list[str] = field(default_factory=list)
    #: a baseline's figures that got worse: shown, not a regression (``gate_baselines``)
    findings: list[str] = field(default_factory=list)
    verdict: tuple[str | None, str | None] = (None, None)
    #: {axis: [old, new]}: the largest rank's wire bytes and calls per step
    wire: dict[str, list] = field(default_factory=dict)
    calls: dict[str, list] = field(default_factory=dict)
    #: {"r<rank>": [old, new]}: each rank's model-state total and peak bytes
    states: dict[str, list] = field(default_factory=dict)
    peak: dict[str, list] = field(default_factory=dict)
    time: TimeDiff = field(default_factory=TimeDiff)

    @property
    def regression(self) -> bool:
        return self.status in ("regression", "missing")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["verdict"] = list(self.verdict)
        d["regression"] = self.regression
        return d


# ---- reading -----------------------------------------------------------------------------


def case_key(row: Row, match: str = "id") -> str:
    """The key two runs' rows are matched by. ``id``: the row's id (``scheme:degrees:digest``,
    the digest of the whole case configuration; no timestamp, so equal configurations give
    equal ids). ``config``: the case configuration without the scheme's name."""
    if match == "id":
        return row.id
    if match == "config":
        case = json.loads(json.dumps(_normalized(row.case.config), default=str))
        case.pop("id", None)
        (case.get("run") or {}).pop("scheme", None)
        return json.dumps(case, sort_keys=True)
    raise ConfigError(f"match={match!r} must be one of {', '.join(MATCHES)}")


def _normalized(config: dict) -> dict:
    """A case configuration as this version writes it (a file of an earlier version may hold
    its ``parallel`` section, or ``cp_kind``), so that ``match=config`` pairs across versions."""
    from ..config import CaseConfig
    try:
        return CaseConfig.from_dict(config).to_dict()
    except (ConfigError, TypeError, ValueError, KeyError):
        return config


def _index(rows: list[Row], match: str, what: str) -> dict[str, Row]:
    """key -> row; a later row of the same scheme supersedes an earlier one, two schemes on
    one key (``match=config``) are ambiguous."""
    out: dict[str, Row] = {}
    for r in rows:
        k = case_key(r, match)
        prior = out.get(k)
        if prior is not None and prior.scheme != r.scheme:
            raise ConfigError(f"match={match}: {what} has {prior.scheme} and {r.scheme} on the "
                              "same case configuration; compare runs of one scheme per case "
                              "(or match=id)")
        out[k] = r
    return out


def match_rows(old: list[Row], new: list[Row], match: str = "id"
               ) -> list[tuple[str, Row | None, Row | None]]:
    """(key, old row or None, new row or None), OLD's order first, then NEW's new cases."""
    a, b = _index(old, match, "OLD"), _index(new, match, "NEW")
    keys = list(a) + [k for k in b if k not in a]
    return [(k, a.get(k), b.get(k)) for k in keys]


# ---- the figures of one row ----------------------------------------------------------------


def verdict_of(row: Row) -> str:
    """pass | inexact | FAIL | CRASHED / HUNG / TIMEOUT (see the module's docstring)."""
    v = row.verdict
    if v.status != "ok":
        return (v.failure.kind if v.failure else "failed").upper()
    if not v.equivalent:
        return "FAIL"
    return "pass" if row.passed else "inexact"


def _rank(verdict: str) -> int:
    return VERDICT_ORDER.get(verdict, 0)


def wire_by_axis(row: Row) -> dict[str, float]:
    """The largest rank's wire bytes per axis."""
    return row.traffic.wire_max()


def calls_by_axis(row: Row) -> dict[str, int]:
    return row.traffic.calls_max()


def states_by_rank(row: Row) -> dict[str, int]:
    return {f"r{i}": t for i, t in enumerate(row.memory.states.totals()) if t is not None}


def peak_by_rank(row: Row) -> dict[str, int]:
    return {f"r{i}": p for i, p in enumerate(row.memory.peak_bytes) if p is not None}


def relative_spread(step_times_s: list) -> float | None:
    """The robust relative standard deviation of one step's time (module docstring), or
    None when no rank kept 2 timed steps."""
    residuals: list[float] = []
    for ts in step_times_s or []:
        ts = [float(t) for t in (ts or []) if t is not None and float(t) > 0]
        if len(ts) < 2:
            continue
        m = statistics.median(ts)
        residuals += [abs(t / m - 1.0) for t in ts]
    if not residuals:
        return None
    return MAD_SIGMA * statistics.median(residuals)


def time_diff(old: Row, new: Row, opts: Options) -> TimeDiff:
    td = TimeDiff(old_s=old.time.step_s, new_s=new.time.step_s)
    if td.old_s and td.new_s:
        td.ratio = td.new_s / td.old_s
    if opts.ignore_time:
        td.note = "ignored"
        return td
    if td.ratio is None:
        td.note = "no timed steps"
        return td
    if opts.time_tol is not None:
        td.threshold, td.source = opts.time_tol, "fixed"
        return td
    td.spread_old = relative_spread(old.time.per_rank_s)
    td.spread_new = relative_spread(new.time.per_rank_s)
    if td.spread_old is None or td.spread_new is None:
        td.note = "no repeated steps"
        return td
    td.threshold = max(TIME_FLOOR, TIME_K * math.hypot(td.spread_old, td.spread_new))
    td.source = "auto"
    return td


# ---- one pair, classified ----------------------------------------------------------------


def label(old: Row | None, new: Row | None) -> str:
    """'scheme degrees' ('old scheme → new scheme degrees' when they differ)."""
    r = new or old
    schemes = [x.scheme for x in (old, new) if x is not None]
    name = schemes[0] if len(set(schemes)) == 1 else " → ".join(schemes)
    return f"{name} {cells.degrees(r)}"


def _grew(old: float, new: float, tol: float, slack: float = BYTES_SLACK) -> bool:
    return new > old * (1.0 + tol) + slack


def _shrank(old: float, new: float, slack: float = BYTES_SLACK) -> bool:
    return new < old - slack


def _pct(old: float, new: float) -> str:
    if not old:
        return ""
    pct = 100 * (new - old) / old
    return f" ({pct:+.1f}%)" if abs(pct) >= 0.1 or not pct else f" ({pct:+.1g}%)"


def signed_bytes(d: float) -> str:
    return ("+" if d > 0 else "-" if d < 0 else "±") + cells.fmt_bytes(abs(d))


def _whats(texts: list[str]) -> str:
    """The 'what' of each reason ('verdict, wire dp')."""
    return ", ".join(t.split(":", 1)[0] for t in texts)


def _worse(d: Diff, gated: bool, text: str) -> None:
    """A figure got worse: a regression where it is gated, else a finding."""
    if gated:
        d.reasons.append(text)
    else:
        d.findings.append(text)


def _figures(d: Diff, name: str, pairs: dict[str, list], tol: float, unit_bytes: bool,
             gated: bool = True) -> None:
    """Regressions (findings where not ``gated``) and improvements of one figure, key by
    key (axis or rank)."""
    for k, (o, n) in pairs.items():
        o, n = o or 0, n or 0
        delta = signed_bytes(n - o) if unit_bytes else f"{n - o:+d}"
        text = f"{name} {k}: {delta}{_pct(o, n)}"
        slack = BYTES_SLACK if unit_bytes else 0
        if _grew(o, n, tol, slack):
            _worse(d, gated, text)
        elif _shrank(o, n, slack):
            d.improvements.append(text)


def _pairs(a: dict, b: dict) -> dict[str, list]:
    return {k: [a.get(k), b.get(k)] for k in sorted(set(a) | set(b), key=_natural)}


def _natural(k: str):
    return (int(k[1:]) if k[:1] == "r" and k[1:].isdigit() else -1, k)


def diff_rows(key: str, old: Row | None, new: Row | None, opts: Options | None = None) -> Diff:
    """Measure and classify one matched pair (either side may be None)."""
    opts = opts or Options()
    d = Diff(key=key, label=label(old, new), old_id=old.id if old else None,
             new_id=new.id if new else None)
    if old is None:
        d.status, d.verdict = "new", (None, verdict_of(new))
        return d
    if new is None:
        d.status, d.verdict = "missing", (verdict_of(old), None)
        d.reasons.append("missing: in OLD, not in NEW")
        return d
    vo, vn = verdict_of(old), verdict_of(new)
    d.verdict = (vo, vn)
    if _rank(vn) < _rank(vo):
        d.reasons.append(f"verdict: {vo} → {vn}")
    elif _rank(vn) > _rank(vo):
        d.improvements.append(f"verdict: {vo} → {vn}")
    measured = old.verdict.status == "ok" and new.verdict.status == "ok"
    # a baseline's figures are findings, as in ``run``'s verdict (its verdict is gated)
    gated = d.gated = new.case.baseline_of is None or opts.gate_baselines
    if measured:
        d.wire = _pairs(wire_by_axis(old), wire_by_axis(new))
        d.calls = _pairs(calls_by_axis(old), calls_by_axis(new))
        d.states = _pairs(states_by_rank(old), states_by_rank(new))
        d.peak = _pairs(peak_by_rank(old), peak_by_rank(new))
        _figures(d, "wire", d.wire, opts.bytes_tol, True, gated)
        _figures(d, "calls", d.calls, opts.bytes_tol, False, gated)
        _figures(d, "states", d.states, opts.bytes_tol, True, gated)
        _figures(d, "peak", d.peak, opts.bytes_tol, True, gated)
    d.time = time_diff(old, new, opts) if measured else TimeDiff(note="no timed steps")
    t = d.time
    if t.threshold is not None and t.ratio is not None:
        if t.ratio > 1.0 + t.threshold:
            _worse(d, gated, f"time: {t.ratio:.2f}× > {1 + t.threshold:.2f}× "
                             f"({t.source} threshold)")
        elif t.ratio < 1.0 / (1.0 + t.threshold):
            d.improvements.append(f"time: {t.ratio:.2f}×")
    if d.reasons:
        d.status = "regression"
    return d


def compare_rows(old: list[Row], new: list[Row], opts: Options | None = None) -> list[Diff]:
    """Every case of either run, matched and classified; ConfigError when no case is in
    both."""
    opts = opts or Options()
    matched = match_rows(old, new, opts.match)
    if not any(o is not None and n is not None for _, o, n in matched):
        hint = "" if opts.match == "config" else \
            " (match=config matches the same case run by another scheme)"
        raise ConfigError(f"OLD and NEW have no case in common (match={opts.match}){hint}")
    return [diff_rows(k, o, n, opts) for k, o, n in matched]
