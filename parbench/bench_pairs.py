"""Every "ours / baseline" pair the suites hold, measured side by side (issue 24:
``scripts/bench_all.py``).

A suite row whose scheme is a framework baseline (``Scheme.baseline_of`` names the native
scheme it stands beside) makes a pair: the same case with the native scheme, and the
baseline's. Each pair runs alternately (``parbench.bench.alternate``: ours, theirs, ours,
...) on one pool per world size, ``repeats`` times, with the benchmark's timed steps; a
pair's figure is the median over the repeats of ours / theirs, each repeat's ratio taken from
the two runs next to each other (slow drift of a shared machine hits both), and its spread
the lowest and highest repeat's ratio. ``instrument`` pairs time a native case with the
ledger, tracker and timeline on against the same case with them off: the instruments' cost.

No assertion on any figure: a benchmark prints what one run measured.
"""
from __future__ import annotations

import hashlib
import statistics
from dataclasses import dataclass, field, replace

from .bench_why import backend_bound, cpu_split, explain
from .config import CaseConfig
from .registry import get_scheme
from .suites import available_suites, load_suite

#: case fields a benchmark sets on every pair: enough timed steps for a median, a warm-up,
#: two checked steps -- the timed steps are held to the last checked step's ledger, and torch
#: DDP's first iteration is not its steady state (its first bucket is capped at 1 MiB and the
#: buckets are rebuilt after it: one all-reduce at step 0 on the tiny model, four from step 1
#: at bucket_mb=0.03), so with one checked step its timed steps fail as a behaviour change
TIMING = {"steps": 2, "timed_steps": 12, "warmup_steps": 2}


@dataclass
class Pair:
    """Ours and the baseline on one case (or, ``kind="instrument"``, one native case with the
    instruments on and off)."""

    ours: CaseConfig
    theirs: CaseConfig
    kind: str = "baseline"
    suites: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        if self.kind == "instrument":
            return f"{self.ours.run.scheme} instruments on / off (alternate steps)"
        return f"{self.ours.run.scheme} / {self.theirs.run.scheme}"

    @property
    def key(self) -> str:
        return f"{self.kind}|{self.ours.id}|{self.theirs.id}"


def _timed(case: CaseConfig, **run_fields) -> CaseConfig:
    run = replace(case.run, **{**TIMING, **run_fields})
    out = replace(case, run=run)
    return replace(out, id=f"{case.id}:bench:{run.scheme}:{int(run.instrument)}")


def suite_pairs(suites: list[str] | None = None) -> list[Pair]:
    """The pairs of the named suites (default: every suite), each once: a baseline row beside
    the same case run by its native scheme. A native scheme that refuses the baseline's case
    (a field only the framework takes) leaves the pair out."""
    pairs: dict[str, Pair] = {}
    for name in suites or list(available_suites()):
        for case in load_suite(name).cases:
            native = get_scheme(case.run.scheme).baseline_of
            if native is None:
                continue
            pair = _pair(case, native)
            if pair is not None:
                pairs.setdefault(_same_case(pair), pair).suites.append(name)
    return list(pairs.values())


def _pair(case: CaseConfig, native: str) -> Pair | None:
    ours = replace(case, run=replace(case.run, scheme=native))
    try:
        get_scheme(native).check(ours)
    except Exception:  # noqa: BLE001 -- a ConfigError or a framework-only field: no pair
        return None
    return Pair(_timed(ours), _timed(case))


def _same_case(pair: Pair) -> str:
    """Two suites holding the same baseline case make one pair."""
    a, b = pair.ours.to_dict(), pair.theirs.to_dict()
    for d in (a, b):
        d.pop("id", None)
    return repr((sorted(a.items()), sorted(b.items())))


def instrument_pairs(pairs: list[Pair]) -> list[Pair]:
    """For each native scheme of ``pairs`` (its first case): instruments on against off --
    one case whose timed steps alternate them (``instrument_ab``: the same ranks, cores and
    placement on both sides, so that a run's placement on shared cores, which moves a whole
    run by tens of percent, cancels); ``theirs`` is the same case, for the pair's key."""
    seen: dict[str, Pair] = {}
    for p in pairs:
        scheme = p.ours.run.scheme
        if scheme not in seen:
            ab = _timed(p.ours, instrument=True, instrument_ab=True)
            seen[scheme] = Pair(ab, ab, kind="instrument", suites=list(p.suites))
    return list(seen.values())


#: a gap measured and explained, per baseline scheme: printed beside its pairs (issue 24:
#: "where a baseline does something ours does not, say so in the benchmark's output")
REASONS: dict[str, str] = {}


@dataclass
class PairResult:
    """One pair's medians (ms), the median ratio and its spread over the repeats; the median
    ratio of the ranks' CPU seconds per step (``cpu_ratio``: the work each side does, which
    a rank descheduled on shared cores does not inflate); ``reason``: the explained gap
    (:data:`REASONS`); ``error``: why the pair has no figure (a run that failed)."""

    label: str
    kind: str
    ours_ms: float
    theirs_ms: float
    ratio: float
    low: float
    high: float
    repeats: int
    #: every row of the pair's runs passed; "finding": the baseline's rows disagree with the
    #: golden run as its known finding says (``Scheme.known_finding``), the rest passed
    passed: bool | str
    case: str
    cpu_ratio: float | None = None
    reason: str = ""
    error: str = ""
    #: the case's own fields, hashed (``case_key``): what a later run's pair is matched by
    key: str = ""
    #: ours / theirs of the calling thread's CPU per step (the scheme's own work) and of the
    #: busiest backend threads'; the measured reason where ours is slower, and whether it is
    #: the backend's (ours' own work less, no more collectives: ``parbench.bench_why``)
    own_ratio: float | None = None
    threads: dict[str, float] = field(default_factory=dict)
    why: str = ""
    backend: bool = False
    #: an instrument pair: the instruments' own-thread CPU as a share of the process's CPU
    #: per step (``parbench.bench_ab``), median over the step pairs and the lowest and
    #: highest run's median
    share: float | None = None
    share_low: float | None = None
    share_high: float | None = None

    def share_text(self) -> str:
        return (f"; the instruments' CPU {self.share:.1%} of the step's "
                f"[{self.share_low:.1%}, {self.share_high:.1%}]")

    def line(self) -> str:
        if self.error:
            return f"{self.label:58s}  no figure: {self.error}  {self.case}"
        ok = {True: "", False: "  (a row FAILED its verdict)",
              "finding": "  (FINDING: the baseline's known disagreement, reproduced)"}[
            self.passed]
        if self.share is not None:  # an instrument pair: its own-thread CPU and share
            cpu = f"  own cpu {self.own_ratio:.3f}x{self.share_text()}"
        else:
            cpu = "" if self.cpu_ratio is None else f"  cpu {self.cpu_ratio:.3f}x"
            cpu += "" if self.own_ratio is None else f" (own {self.own_ratio:.3f}x)"
        why = f"  -- {self.reason}" if self.reason else ""
        if self.why and self.ratio > 1.0 and not self.reason:
            why = f"  -- {self.why}"
        return (f"{self.label:58s} {self.ratio:6.3f}x  [{self.low:.3f}, {self.high:.3f}]  "
                f"n={self.repeats}  {self.ours_ms:8.2f} / {self.theirs_ms:8.2f} ms{cpu}  "
                f"{self.case}{ok}{why}")


def _where(pair: Pair) -> str:
    c = pair.ours
    return (f"{c.model.name} tp{c.layout.tp} cp{c.layout.cp} ep{c.layout.ep} dp{c.layout.dp} "
            f"pp{c.layout.pp} {c.run.dtype} ({', '.join(pair.suites)})")


def case_key(pair: Pair) -> str:
    """A short stable name of the pair's cases (every field of both, hashed): two runs of
    bench_all match their pairs by it, whatever the suites' order."""
    return pair.kind + ":" + hashlib.sha1(_same_case(pair).encode()).hexdigest()[:12]


def _repeat_ratios(ours: list, theirs: list) -> list[float]:
    return [x / y for x, y in zip(ours, theirs) if x and y]


def _passed(rows: list) -> bool | str:
    """True when every row passed; "finding" when the failing ones are a baseline's known
    finding, reproduced (labelled FINDING by ``run``); else False."""
    failing = [r for r in rows if not r.passed]
    if not failing:
        return True
    finding = all(getattr(getattr(r, "verdict", None), "known_finding", None) for r in failing)
    return "finding" if finding else False


def summarise(pair: Pair, ours_rows: list, theirs_rows: list) -> PairResult:
    """The pair's figures from its rows, repeat by repeat (``step_s``: the slowest rank's
    median timed step of that run; ``cpu_s``: the largest rank's median CPU seconds)."""
    a = [r.time.step_s for r in ours_rows]
    b = [r.time.step_s for r in theirs_rows]
    ratios = _repeat_ratios(a, b)
    cpu = _repeat_ratios([getattr(r.time, "cpu_s", None) for r in ours_rows],
                         [getattr(r.time, "cpu_s", None) for r in theirs_rows])
    split = cpu_split(ours_rows, theirs_rows)
    nan = float("nan")
    return PairResult(pair.label, pair.kind, statistics.median(a) * 1e3,
                      statistics.median(b) * 1e3,
                      statistics.median(ratios) if ratios else nan,
                      min(ratios, default=nan), max(ratios, default=nan),
                      len(ratios), _passed(ours_rows + theirs_rows), _where(pair),
                      cpu_ratio=statistics.median(cpu) if cpu else None,
                      reason=REASONS.get(pair.theirs.run.scheme, "") if pair.kind == "baseline"
                      else "", key=case_key(pair), own_ratio=split.own,
                      threads=split.threads, why=explain(split), backend=backend_bound(split))


def failed(pair: Pair, exc: BaseException) -> PairResult:
    """A pair whose runs raised: no figure, the error's first line (the run goes on)."""
    first = (str(exc).strip().splitlines() or [""])[0][:160]
    nan = float("nan")
    return PairResult(pair.label, pair.kind, nan, nan, nan, nan, nan, 0, False, _where(pair),
                      error=f"{type(exc).__name__}: {first}", key=case_key(pair))


def goals(results: list[PairResult]) -> str:
    """Issue 24's goals over the run: baseline pairs above 1.00x without a stated reason
    (apart: those with the measured reason of ``parbench.bench_why``), instrument pairs above
    3% of the step, pairs with no figure."""
    slow = [r for r in results if r.kind == "baseline" and not r.error and r.ratio > 1.0
            and not r.reason]
    backend = [r for r in slow if r.backend]
    # an instrument pair is above its goal when the instruments' CPU is above 3% of the
    # step's (the precise figure; the wall ratio above 1.03x where it was not measured)
    heavy = [r for r in results if r.kind == "instrument" and not r.error
             and (r.share > 0.03 if r.share is not None else r.ratio > 1.03)]
    broken = [r for r in results if r.error]
    lines = [f"\ngoals: {len(slow) - len(backend)} baseline pair(s) above 1.00x without a "
             f"reason, {len(backend)} above with a measured one (ours' own work less, no more "
             f"collectives: the backend's threads), {len(heavy)} instrument pair(s) above "
             f"3% of the step, {len(broken)} without a figure"]
    lines += [_above(r, 1.0) for r in slow] + [_above(r, 1.03) for r in heavy]
    return "\n".join(lines)


def _above(r: PairResult, goal: float) -> str:
    """One pair above its goal: its figure, whether every repeat (run) is above, its why."""
    if r.share is not None:
        every = ("every run's instruments' CPU above 3%" if r.share_low > 0.03 else
                 "a run's instruments' CPU at or below 3%")
        why = f" --{r.share_text()[1:]}"
    else:
        every = ("every repeat above" if r.low > goal else "a repeat at or below") + \
            f" {goal:.2f}x"
        why = f" -- {r.why}" if r.why else ""
    return f"  above: {r.label} {r.ratio:.3f}x [{r.low:.3f}, {r.high:.3f}] ({every}) {r.case}{why}"
